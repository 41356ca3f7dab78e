"""The run configuration of a diffusion run: `milepost train RECIPE.toml` with a `[diffusion]` table.

The same recipe machinery as `milepost train` (TOML tables + `--key value`, strict types, the
resolved config written into the run directory); invalid combinations are refused at start.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from milepost.recipe import (
    ConfigError,
    dump_toml,
    parse_overrides,
    read_recipe,
    validate_strict,
)

RESOLVED_NAME = "config.resolved.toml"
BUILTIN_REWARDS = ("brightness", "shape_brightness", "colourfulness", "jpeg_compressibility", "shape_classifier")


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class DiffusionTable(_Table):
    diffusion_checkpoint: Path = Field(description="Tiny DiT directory (python -m milepost.diffusion.prepare DIR writes DIR/base_model).")
    classifier_path: Path | None = Field(None, description="Shape classifier directory: the quality check every step and the shape_classifier reward.")
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="Engine and trainer device.")
    seed: int = Field(0, ge=0, description="Seed of prompts, noise and training.")
    deterministic: bool = Field(False, description="Forward and backward repeatable bit for bit (same hardware, same threads): deterministic kernels, seeds per step, attention 'math'.")
    attention_backend: Literal["math", "sdpa"] = Field("math", description="math: one fixed kernel (deterministic); sdpa: torch picks (flash / memory-efficient on GPU, no deterministic switch: refused with deterministic).")
    param_dtype: Literal["float32", "bfloat16"] = Field("float32", description="Compute dtype of the trainer's parameters (FSDP2 mixed-precision policy); master weights stay FP32.")
    fp32_modules: list[str] = Field(["t_embedder", "adaLN_modulation"], description="Module name parts kept in FP32 when param_dtype is bfloat16 (timestep embedders, modulation tables).")
    trainer_backend: Literal["plain", "fsdp2"] = Field("plain", description="plain: the module as is; fsdp2: fully_shard per block with per-module mixed-precision policies (one rank here).")


class DiffusionRolloutTable(_Table):
    num_rollout: int = Field(30, ge=1, description="RL steps (rollout + train + weight update).")
    rollout_batch_size: int = Field(4, ge=1, description="Prompts (class labels) per step.")
    n_samples_per_prompt: int = Field(4, ge=1, description="Images per prompt: one group, one microgroup sharing its condition.")
    num_denoising_steps: int = Field(8, ge=1, le=1000, description="SDE steps per image.")
    guidance_scale: float = Field(1.0, ge=0.0, description="Classifier-free guidance weight (1 = off).")
    noise_level: float = Field(0.7, gt=0.0, le=2.0, description="Flow-GRPO's a in sigma_t = a sqrt(t/(1-t)).")
    time_shift: float = Field(1.0, gt=0.0, description="SD3 time shift of the denoising grid.")
    diffusion_train_timesteps: list[int] | None = Field(None, description="Denoising step indices the trainer re-scores (Flow-GRPO) or trains at (NFT, as times); none = every step.")
    reward_fn: str = Field("brightness", description=f"A built-in ({', '.join(BUILTIN_REWARDS)}) or module:function(images [B,3,H,W] in [-1,1], labels [B]) -> [B] floats.")
    brightness_target: float = Field(0.65, ge=0.0, le=1.0, description="Mean luminance the brightness reward wants (reward 1 there, 0 at 0.25 away).")
    quality_probe: int = Field(0, ge=0, le=4096, description="Images of the fixed quality probe (same labels, seeds and sampler every time; needs classifier_path): the classifier's accuracy on it before training and every quality_every steps (quality/probe_accuracy). 0 = off.")
    quality_every: int = Field(10, ge=1, description="Steps between quality probes (the last step is always probed).")
    transfer_format: Literal["bytes", "json"] = Field("bytes", description="Trajectory body: raw bytes (unpacked in a process pool) or JSON (for comparison).")


class DiffusionAlgorithmTable(_Table):
    diffusion_objective: Literal["flow_grpo", "nft", "sft"] = Field("flow_grpo", description="flow_grpo: clipped ratio on re-scored SDE steps; nft: DiffusionNFT forward-process loss; sft: flow-matching loss on sft_data.")
    eps_clip: float = Field(1e-3, gt=0.0, description="Flow-GRPO ratio clip (its paper uses 1e-4..1e-3: per-step ratios are close to 1).")
    kl_loss_coef: float = Field(0.01, ge=0.0, description="Weight of the KL to the reference (base) model.")
    adv_clip_max: float = Field(5.0, gt=0.0, description="Advantages clipped to +-this.")
    nft_beta: float = Field(1.0, gt=0.0, description="DiffusionNFT's beta: implicit policies v_old +- beta (v_theta - v_old).")
    nft_kl_coef: float = Field(0.0, ge=0.0, description="DiffusionNFT: weight of ||v_theta - v_ref||^2, the squared velocity gap to the reference (base) model (the paper's KL for flow models); restrains reward hacking. 0 = off.")
    sft_data: Path | None = Field(None, description="For sft: .npz with images [N,3,H,W] in [-1,1] and labels [N] (prepare writes DIR/sft_images.npz).")
    inner_epochs: int = Field(1, ge=1, description="Optimizer passes over one rollout batch.")


class DiffusionOptimizerTable(_Table):
    lr: float = Field(3e-4, gt=0.0, description="Adam learning rate.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam beta2.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    clip_grad: float = Field(1.0, gt=0.0, description="Gradient norm clip.")
    lora_rank: int = Field(0, ge=0, description="0 = full fine-tune; >0 = LoRA on attention/MLP linears, merged into the engine's weights on arrival.")
    lora_alpha: float = Field(16.0, gt=0.0, description="LoRA scale alpha / rank.")


class DiffusionCheckpointTable(_Table):
    run_dir: Path | None = Field(None, description="Directory of this run (metrics.jsonl, engine log, image grids).")
    weight_transport: Literal["tensor", "disk", "broadcast", "p2p"] = Field("tensor", description="tensor: /update_weights_from_tensor (SGLang's body); disk: safetensors in run_dir + /update_weights_from_disk; broadcast: a gloo group of trainer and engine, /update_weights_from_distributed (the text engine's BroadcastTransport); p2p: refused (one engine, one trainer rank: nothing to spread).")
    check_weight_update: bool = Field(True, description="After each update, compare the engine's weight checksums with the trainer's.")
    save_grids: bool = Field(True, description="Write before/after image grids (run_dir/grids) for `milepost report`.")


TABLES: dict[str, type[BaseModel]] = {
    "diffusion": DiffusionTable, "rollout": DiffusionRolloutTable, "algorithm": DiffusionAlgorithmTable,
    "optimizer": DiffusionOptimizerTable, "checkpoint": DiffusionCheckpointTable,
}
TABLE_OF: dict[str, str] = {name: t for t, cls in TABLES.items() for name in cls.model_fields}


class DiffusionConfig(DiffusionCheckpointTable, DiffusionOptimizerTable, DiffusionAlgorithmTable,
                      DiffusionRolloutTable, DiffusionTable):
    """Validated at construction; refusals name the setting and the fix."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _resolve(self) -> DiffusionConfig:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("diffusion_checkpoint", self.diffusion_checkpoint.absolute())
        if self.deterministic and self.attention_backend != "math":
            raise ValueError("--deterministic with --attention-backend sdpa: torch's fused attention kernels have "
                             "no deterministic switch; use --attention-backend math")
        steps = self.diffusion_train_timesteps
        if steps is not None:
            bad = [s for s in steps if not 0 <= s < max(self.num_denoising_steps - 1, 1)]
            if bad or not steps or len(set(steps)) != len(steps):
                raise ValueError(f"--diffusion-train-timesteps {steps}: give distinct step indices in "
                                 f"0..{max(self.num_denoising_steps - 2, 0)} (the last of --num-denoising-steps "
                                 f"{self.num_denoising_steps} is deterministic)")
        from milepost.diffusion.hf import is_diffusers_dir

        if self.diffusion_objective == "sft" and is_diffusers_dir(self.diffusion_checkpoint):
            raise ValueError(f"--diffusion-objective sft with the diffusers pipeline {self.diffusion_checkpoint}: SFT data "
                             "are images and this model trains on VAE latents (not supported yet); use flow_grpo or nft")
        if self.diffusion_objective == "sft" and self.sft_data is None:
            raise ValueError("--diffusion-objective sft needs --sft-data (prepare writes DIR/sft_images.npz)")
        if self.diffusion_objective != "sft" and self.n_samples_per_prompt < 2:
            raise ValueError(f"--diffusion-objective {self.diffusion_objective} normalizes rewards within a group: "
                             "--n-samples-per-prompt must be >= 2")
        if self.weight_transport == "p2p":
            raise ValueError("--weight-transport p2p spreads an update over several trainer ranks and engines; a "
                             "diffusion run has one of each: use broadcast (a gloo group), tensor or disk")
        if self.reward_fn == "shape_classifier" and self.classifier_path is None:
            raise ValueError("--reward-fn shape_classifier needs --classifier-path (prepare writes DIR/classifier)")
        if self.quality_probe and self.classifier_path is None:
            raise ValueError("--quality-probe needs --classifier-path (prepare writes DIR/classifier)")
        if self.reward_fn not in BUILTIN_REWARDS and ":" not in self.reward_fn:
            raise ValueError(f"--reward-fn {self.reward_fn!r}: use a built-in {BUILTIN_REWARDS} or module:function")
        if self.device == "auto":
            import torch

            put("device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.param_dtype == "bfloat16" and self.trainer_backend != "fsdp2":
            raise ValueError("--param-dtype bfloat16 is applied by FSDP2's mixed-precision policy: set --trainer-backend fsdp2")
        put("run_dir", (self.run_dir or Path("runs") / "diffusion").expanduser().absolute())
        return self

    def write_resolved(self) -> Path:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / RESOLVED_NAME
        tmp = path.with_suffix(".toml.tmp")
        tmp.write_text(dump_toml(self, TABLE_OF, f"Resolved settings of this diffusion run; rerun with\n  milepost train {path}"))
        os.replace(tmp, path)
        return path


def is_diffusion_recipe(path: Path | str | None) -> bool:
    """Whether a recipe file is a diffusion run (it has a [diffusion] table)."""
    import tomllib

    if path is None or not Path(path).is_file():
        return False
    try:
        return isinstance(tomllib.loads(Path(path).read_text()).get("diffusion"), dict)
    except tomllib.TOMLDecodeError:
        return False


def load_diffusion_config(recipe: Path | str | None, overrides: list[str] | None = None) -> DiffusionConfig:
    """The validated config of `recipe` then `overrides`; ConfigError naming every fault."""
    values: dict[str, Any] = {}
    if recipe is not None:
        values.update(read_recipe(Path(recipe), TABLE_OF))
    values.update(parse_overrides(DiffusionConfig, list(overrides or [])))
    try:
        return validate_strict(DiffusionConfig, values)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def _format_errors(err: ValidationError) -> str:
    """One line per fault, naming the flag: `--noise-level: Input should be greater than 0; got 0.0`."""
    from milepost.flags import flag_name

    lines = []
    for e in err.errors():
        msg, loc = e["msg"].removeprefix("Value error, "), e["loc"]
        if loc and isinstance(loc[0], str) and loc[0] in TABLE_OF:
            if e["type"] == "missing":
                lines.append(f"{flag_name(loc[0])} is required: set {loc[0]} in the recipe's [{TABLE_OF[loc[0]]}] table")
            else:
                lines.append(f"{flag_name(loc[0])}: {msg}; got {e['input']!r}")
        else:
            lines.append(msg)
    return "\n".join(lines)
