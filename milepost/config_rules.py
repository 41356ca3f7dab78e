"""Invalid combinations of a TrainConfig, refused at start, and its derived defaults.

Each refusal names every setting involved and the fix; all of them are reported at once.
Fully-async checks (e.g. fully async + colocate) join `refusals` with the fully-async flags.
"""

from __future__ import annotations

import ast
import datetime as _dt
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milepost.config_rules_loop import (
    eval_refusals,
    fully_async_refusals,
    objective_refusals,
)
from milepost.config_rules_parts import (
    agent_refusals,
    model_refusals,
    session_server_enabled,
    weight_update_refusals,
)
from milepost.connectors.env import env_refusals, episode_env_refusals
from milepost.lora.rules import lora_refusals
from milepost.mtp_rules import mtp_refusals
from milepost.lowprec.rules import precision_refusals, ratio_correction_default
from milepost.onpolicy.rules import true_on_policy_refusals
from milepost.opd_rules import opd_coef_default, opd_refusals

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def default_run_dir(name: str = "run") -> Path:
    """runs/<name>-<YYYYmmdd-HHMMSS> under the current directory."""
    return Path("runs") / f"{name}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def refusals(c: TrainConfig) -> list[str]:
    """Every invalid combination, each naming the settings at fault and the fix."""
    p: list[str] = []
    if c.device == "cuda" and not _cuda_available():
        p.append("--device cuda was given but CUDA is not available; use --device cpu or auto")
    if c.prompt_data is None and c.load_rollouts is None and c.env is None and not c.adapters:
        p.append(
            "--prompt-data is required (a JSONL or Parquet file of prompts), unless --load-rollouts "
            "trains on saved rollouts or --env makes them"
        )
    p += env_refusals(c.env, prompt_data=c.prompt_data, reward_fn=c.reward_fn,
                      load_rollouts=c.load_rollouts)
    p += episode_env_refusals(c)
    if c.compile_layers and c.activation_checkpointing != "none":
        p.append("--compile-layers with --activation-checkpointing layer is not supported yet: "
                 "drop one of them")
    if c.load_rollouts is not None and c.rollout_only:
        p.append("--load-rollouts with --rollout-only would neither generate nor train; drop one of them")
    if c.engine_backend == "external" and not c.engine_urls:
        p.append("--engine-backend external needs --engine-urls (the servers' http://host:port)")
    if c.engine_backend != "external" and c.engine_urls:
        p.append(
            f"--engine-urls is only for --engine-backend external (got --engine-backend "
            f"{c.engine_backend}, whose engines milepost starts); drop --engine-urls or use external"
        )
    if (
        c.engine_backend == "external"
        and c.engine_urls
        and c.rollout_num_engines is not None
        and c.rollout_num_engines != len(c.engine_urls)
    ):
        p.append(
            f"--rollout-num-engines {c.rollout_num_engines} differs from the {len(c.engine_urls)} "
            "--engine-urls; drop --rollout-num-engines (it follows the URLs)"
        )
    if c.engine_quantization is not None and c.engine_backend != "embedded":
        p.append(
            f"--engine-quantization {c.engine_quantization} is milepost's engine storage (and its "
            f"check tolerance); --engine-backend {c.engine_backend} engines are configured where "
            "they start: drop --engine-quantization or use embedded"
        )
    if c.colocate and c.engine_backend == "external":
        p.append(
            "--colocate needs engines milepost starts beside the trainer, but --engine-backend external "
            "engines run elsewhere; drop --colocate or use embedded"
        )
    if c.colocate and c.update_weight_transfer_mode not in (None, "tensor"):
        p.append(
            f"--colocate moves weights by in-host handoff; --update-weight-transfer-mode "
            f"{c.update_weight_transfer_mode} is refused with it: use tensor (the default when colocated)"
        )
    if c.engine_backend == "embedded" and c.rollout_num_gpus_per_engine > 1:
        p.append(
            "--rollout-num-gpus-per-engine > 1 needs tensor parallelism, which --engine-backend embedded "
            "does not have; use 1 or --engine-backend sglang"
        )
    if c.engine_backend == "sglang" and importlib.util.find_spec("sglang") is None:
        p.append(
            "--engine-backend sglang needs the sglang package, which is not installed; use --engine-backend "
            "embedded (same protocol) or external"
        )
    if c.eps_clip_high < c.eps_clip:
        p.append(
            f"--eps-clip-high ({c.eps_clip_high}) is below --eps-clip ({c.eps_clip}); clip-higher "
            "needs eps_clip_high >= eps_clip"
        )
    if c.kl_loss_coef > 0 and not c.use_kl_loss:
        p.append(
            f"--kl-loss-coef {c.kl_loss_coef} has no effect without --use-kl-loss; add --use-kl-loss "
            "or set --kl-loss-coef 0"
        )
    p += objective_refusals(c)
    if c.min_lr > c.lr:
        p.append(f"--min-lr ({c.min_lr}) is above --lr ({c.lr}); the decay goes down to min_lr")
    samples = c.rollout_batch_size * c.n_samples_per_prompt
    if c.global_batch_size is not None and samples % c.global_batch_size:
        p.append(
            f"--global-batch-size {c.global_batch_size} must divide --rollout-batch-size * "
            f"--n-samples-per-prompt = {c.rollout_batch_size} * {c.n_samples_per_prompt} = {samples}"
        )
    gbs = c.global_batch_size or samples
    if gbs % c.actor_num_gpus_per_node:
        p.append(
            f"--global-batch-size {gbs} (default: rollout_batch_size * n_samples_per_prompt) must be a "
            f"multiple of --actor-num-gpus-per-node {c.actor_num_gpus_per_node} (each rank takes a share)"
        )
    p += eval_refusals(c)
    p += fully_async_refusals(c)
    p += weight_update_refusals(c)
    p += model_refusals(c)
    p += agent_refusals(c)
    p += opd_refusals(c)
    p += lora_refusals(c)
    p += mtp_refusals(c)
    p += precision_refusals(c)
    p += true_on_policy_refusals(c)
    if c.use_tensorboard and importlib.util.find_spec("tensorboard") is None:
        p.append("--use-tensorboard needs the tensorboard package: pip install tensorboard")
    if c.use_wandb and importlib.util.find_spec("wandb") is None:
        p.append("--use-wandb needs the wandb package: pip install wandb (it runs offline here)")
    if c.device == "cuda" and not p:
        p += _gpu_count_refusals(c)
    return p


def _cuda_available() -> bool:
    if "torch" not in sys.modules and not _torch_built_for_gpus():
        return False  # a CPU build: known without importing torch (~1.5 s at every run's start)
    import torch  # deferred: only a run that asks about CUDA pays for importing torch

    return torch.cuda.is_available()


def _torch_built_for_gpus() -> bool:
    """False when the installed torch is built with neither CUDA nor ROCm (`torch.version.cuda`
    and `.hip` both None), read from torch/version.py without importing torch; True when unsure."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True
    values: dict[str, ast.expr] = {}
    try:
        tree = ast.parse((Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                values[node.target.id] = node.value
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                values[node.targets[0].id] = node.value
        return "cuda" not in values or "hip" not in values or any(
            ast.literal_eval(values[k]) for k in ("cuda", "hip"))
    except (OSError, SyntaxError, ValueError):
        return True


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _gpu_count_refusals(c: TrainConfig) -> list[str]:
    engines = c.rollout_num_engines or 1
    engine_gpus = 0 if c.engine_backend == "external" else engines * c.rollout_num_gpus_per_engine
    need = (
        max(c.actor_num_gpus_per_node, engine_gpus) if c.colocate else c.actor_num_gpus_per_node + engine_gpus
    )
    have = _visible_gpus()
    if need <= have:
        return []
    how = "max of" if c.colocate else "sum of"
    return [
        f"this placement needs {need} GPUs ({how} --actor-num-gpus-per-node {c.actor_num_gpus_per_node} and "
        f"--rollout-num-engines * --rollout-num-gpus-per-engine = {engine_gpus}) but {have} are visible; "
        "lower them" + ("" if c.colocate else " or use --colocate")
    ]


def resolve_defaults(c: TrainConfig) -> None:
    """Fill derived defaults in place (the model is frozen afterwards; this runs inside validation)."""

    def put(name: str, value: Any) -> None:
        object.__setattr__(c, name, value)

    if c.device == "auto":
        put("device", "cuda" if _cuda_available() else "cpu")
    if c.dtype == "auto":
        put("dtype", "bfloat16" if c.device == "cuda" else "float32")
    if c.max_tokens_per_micro_batch is None:  # measured: docs/training_speed.md
        put("max_tokens_per_micro_batch", 16384 if c.device == "cuda" else 4096)
    if c.rollout_num_engines is None:
        put("rollout_num_engines", len(c.engine_urls) if c.engine_urls else 1)
    if c.router is None:
        put("router", c.rollout_num_engines > 1)  # type: ignore[operator]
    if c.global_batch_size is None:
        put("global_batch_size", c.samples_per_rollout)
    if c.loss_aggregation is None:
        put("loss_aggregation", "sequence_mean" if c.advantage_estimator == "gspo" else "token_mean")
    if c.rollout_max_concurrency is None:
        put("rollout_max_concurrency", c.samples_per_rollout)
    if c.update_weight_transfer_mode is None:
        put("update_weight_transfer_mode", "tensor" if c.colocate else "broadcast")
    if c.update_weight_transfer_mode == "disk-delta" and c.update_weight_delta_dir is None:
        put("update_weight_delta_dir", Path(c.run_dir or default_run_dir()).absolute() / "weight_deltas")
    if c.run_dir is None:
        put("run_dir", default_run_dir().absolute())
    if ratio_correction_default(c):  # a bf16 trainer beside quantized engines: TIS (report 3.1)
        put("ratio_correction", ratio_correction_default(c))
    if c.use_rollout_logprobs is None:
        put("use_rollout_logprobs", c.fully_async and c.ratio_correction == "none")
    if c.offload_train is None:
        put("offload_train", c.colocate)  # the colocated engine needs the memory back
    if c.offload_actor_for_critic is None:
        put("offload_actor_for_critic", c.advantage_estimator == "ppo" and c.device == "cuda")
    if c.offload_train_dir is None and c.offload_train_destination == "disk":
        put("offload_train_dir", c.run_dir / "offload")
    if c.optimizer_state_dir is None and c.stream_optimizer_state_to_disk:
        put("optimizer_state_dir", c.run_dir / "optimizer_state")
    if (c.deterministic or c.true_on_policy) and c.trainer_cpu_threads is None:
        put("trainer_cpu_threads", 1)  # a reduction's order depends on the thread count
    if c.fully_async and c.max_inflight is None:
        put("max_inflight", c.samples_per_rollout)
    if c.fully_async and c.rollout_granularity is None:
        put("rollout_granularity", "sample")  # the report's default under fully async
    put("opd_coef", opd_coef_default(c))
    if c.opd_teacher_checkpoint is not None:
        put("opd_teacher_checkpoint", c.opd_teacher_checkpoint.absolute())


__all__ = ["default_run_dir", "refusals", "resolve_defaults", "session_server_enabled"]
