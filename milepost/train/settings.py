"""`TrainerSettings`: exactly the knobs a training backend needs, validated on construction.

The run config (milepost/config.py) maps its fields onto this dataclass; names follow the report's
flags (`--lr`, `--eps-clip-high`, `--kl-loss-type`, ...). Backends never read the run config itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from milepost.lora.settings import TARGET_MODULES, LoraSettings

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_TYPES = ("policy_loss", "sft_loss", "custom_loss")
LR_DECAY_STYLES = ("constant", "cosine")


@dataclass(frozen=True)
class TrainerSettings:
    """Optimizer, schedule, batching, loss and placement settings of one trainer.

    lr / min_lr: peak and final learning rate (min_lr only matters for cosine decay).
    lr_warmup_iters: optimizer steps of linear warmup, lr * (i + 1) / lr_warmup_iters at step i.
    lr_decay_style: "constant" or "cosine" (cosine from lr to min_lr over num_steps_total steps).
    num_steps_total: optimizer steps of the whole run (not rollouts); required for cosine.
    weight_decay, adam_beta1, adam_beta2, adam_eps: AdamW.
    clip_grad: max global gradient norm; <= 0 disables clipping (the norm is still reported).
    global_batch_size: samples per optimizer step, over all ranks; a multiple of the world size.
    max_tokens_per_micro_batch: token budget of one packed forward/backward; an optimizer step's
        samples are packed longest-first into as few micro-batches as fit (a longer sample runs alone).
        16384 by default: on the H200 a Qwen3-0.6B step of 16k tokens took 0.21 s in one
        micro-batch against 0.39 s in two of 8192 (the step is host-bound per micro-batch),
        peak 27.6 GiB (docs/training_speed.md).
    activation_checkpointing: "none" keeps every layer's activations for backward; "layer"
        recomputes each decoder layer in backward (less memory, about one more forward of compute).
    compile_layers: torch.compile each decoder layer's forward (fuses its elementwise ops; attention
        stays eager); dense models, without activation checkpointing. Off by default: not yet
        measured on a GPU.
    fused_kernels: on CUDA, Triton kernels with backward for RMSNorm, RoPE, SiLU-and-mul and the
        LM head's log-prob + entropy (milepost/kernels/train_fused.py, fused_logprob.py); off = the
        torch ops (the reference path). No effect on CPU.
    separate_old_logprob_pass: always score the old policy in its own no-grad pass before training.
    enable_mtp_training: train the checkpoint's multi-token-prediction layer beside the policy
        (train/mtp.py): its cross-entropy on the response tokens, inputs detached, times
        mtp_loss_scaling_factor. Off: the MTP layer stays as loaded (and is exported as such).
        Off (default): with one optimizer step per rollout the old log-probs are the training
        forward's own, detached (the same numbers, one forward fewer); several optimizer steps
        per rollout always take the separate pass.
    eps_clip / eps_clip_high: PPO ratio clip range [1 - eps_clip, 1 + eps_clip_high] (high defaults to low).
    use_kl_loss / kl_loss_coef / kl_loss_type: KL to a frozen reference model (k1 | k2 | k3). The
        reference model exists only when use_kl_loss; coef 0 then logs the KL without penalizing it.
    entropy_coef: weight of the entropy bonus (subtracted from the loss).
    temperature: the rollout sampling temperature; log-probs are log_softmax(logits / temperature),
        the distribution the engine reports, so the train-rollout comparison is like for like.
    logprob_chunk_size: tokens per chunk of the LM head + log_softmax (bounds fp32 logit memory).
    kl_in_reward: the driver folds a KL-to-reference penalty into the rewards (needs the reference model).
    loss_type / custom_loss_function_path: policy_loss | sft_loss | custom_loss (module:function,
        see milepost/train/losses.py for the interface).
    loss_aggregation: token_mean | sequence_mean. ratio_level: token (PPO/GRPO) | sequence (GSPO).
    ratio_correction / tis_clip_low / tis_clip: none | tis | clip_or_pop over [low, high]
        (milepost/train/corrections.py); needs rollout log-probs in the batch.
    critic_lr / value_clip / critic_hf_checkpoint: a value model (PPO) trained in the same ranks;
        critic_lr None = no critic. The critic starts from critic_hf_checkpoint (default: the policy's).
    use_rollout_routing_replay: MoE forwards use TrainBatch.routed_experts (R3); refused on dense models.
    offload_destination / offload_dir / offload_staging_bytes: where `offload()` puts the trainer's
        tensors: pinned host memory, or per-rank files under offload_dir through a staging buffer.
    actor_critic_turns: with a critic, the actor and the critic take turns on the device within a
        step (--offload-actor-for-critic): one is evicted while the other computes or trains.
    use_distributed_optimizer: --train-backend megatron: megatron-core's distributed optimizer (DDP
        grad buffers reduce-scattered over data parallel, each rank's Adam state 1/DP of the weights).
    optimizer_state_dir: set = stream the Adam moments from per-rank files there (bucketed by
        optimizer_bucket_bytes; moments in optimizer_moment_dtype, float32 = bitwise AdamW).
    true_on_policy: the kernel contract of milepost/onpolicy/contract.py: one sample per
        micro-batch, the torch ops (no fused kernels), LOGPROB_CHUNK rows per LM-head chunk, so
        the log-probs equal the engine's re-score of the same sequence bit for bit.
    seed: seeds torch / python / numpy at creation.
    dtype: compute dtype ("float32" | "bfloat16"); master weights and optimizer state stay fp32,
        exported weights are in this dtype.
    device: "cpu" (gloo) or "cuda" (NCCL; rank r uses cuda:(r % device_count)).
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: Literal["constant", "cosine"] = "constant"
    num_steps_total: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    global_batch_size: int = 32
    max_tokens_per_micro_batch: int = 16384
    activation_checkpointing: Literal["none", "layer"] = "none"
    separate_old_logprob_pass: bool = False
    enable_mtp_training: bool = False
    mtp_loss_scaling_factor: float = 0.1
    compile_layers: bool = False
    fused_kernels: bool = True
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "k1"
    entropy_coef: float = 0.0
    kl_in_reward: bool = False
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = "policy_loss"
    custom_loss_function_path: str | None = None
    loss_aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    ratio_level: Literal["token", "sequence"] = "token"
    ratio_correction: Literal["none", "tis", "clip_or_pop"] = "none"
    tis_clip_low: float = 0.0
    tis_clip: float = 2.0
    critic_lr: float | None = None
    value_clip: float = 0.2
    critic_hf_checkpoint: str | None = None
    use_rollout_routing_replay: bool = False
    temperature: float = 1.0
    logprob_chunk_size: int = 1024
    true_on_policy: bool = False
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    offload_destination: Literal["host", "disk"] = "host"
    offload_dir: str | None = None
    offload_staging_bytes: int = 64 << 20
    actor_critic_turns: bool = False
    use_distributed_optimizer: bool = False
    optimizer_state_dir: str | None = None
    optimizer_bucket_bytes: int = 256 << 20
    optimizer_moment_dtype: Literal["float32", "bfloat16"] = "float32"
    opd_teacher_checkpoint: str | None = None  # in-process distillation teacher (HF directory)
    # LoRA (milepost/lora/): rank 0 = full-parameter training; > 0 trains adapters on a frozen base.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_target_modules: tuple[str, ...] = TARGET_MODULES
    # Low precision (milepost/lowprec/): the trainer's format and the contract's overrides.
    precision: Literal["bf16", "fp8_block", "mxfp8", "nvfp4", "int4"] = "bf16"
    precision_overrides: tuple[tuple[str, str], ...] = ()
    nvfp4_four_over_six: bool = False
    nvfp4_dequantized_backward: bool = False
    nvfp4_stochastic_rounding: bool = False  # NVFP4 trainer: SR of the output gradient
    # FP8 trainer scaling (milepost/lowprec/delayed.py): current per-block, or delayed from history.
    fp8_scaling: str = "current"
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_margin: int = 0
    lora_adapters: tuple[tuple[str, float], ...] = ()  # multi-LoRA: (name, lr) of each adapter

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"TrainerSettings: {msg}")

        need(self.lr >= 0 and 0 <= self.min_lr <= self.lr, f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr})")
        need(self.lr_warmup_iters >= 0, f"lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        need(self.lr_decay_style in LR_DECAY_STYLES, f"lr_decay_style must be one of {LR_DECAY_STYLES}")
        need(
            self.lr_decay_style != "cosine" or self.num_steps_total > self.lr_warmup_iters,
            f"lr_decay_style='cosine' needs num_steps_total ({self.num_steps_total}) > lr_warmup_iters "
            f"({self.lr_warmup_iters}): set num_steps_total to the run's number of optimizer steps",
        )
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, "adam betas must lie in [0, 1)")
        need(self.adam_eps > 0 and self.weight_decay >= 0, "need adam_eps > 0 and weight_decay >= 0")
        need(self.global_batch_size > 0, f"global_batch_size must be > 0, got {self.global_batch_size}")
        need(self.max_tokens_per_micro_batch > 0, "max_tokens_per_micro_batch must be > 0")
        need(self.activation_checkpointing in ("none", "layer"),
             f"activation_checkpointing must be 'none' or 'layer', got {self.activation_checkpointing!r}")
        need(not (self.compile_layers and self.activation_checkpointing != "none"),
             "compile_layers with activation_checkpointing='layer' is not supported yet: choose one")
        need(self.eps_clip > 0 and (self.eps_clip_high is None or self.eps_clip_high > 0), "eps_clip(_high) must be > 0")
        need(self.kl_loss_type in KL_TYPES, f"kl_loss_type must be one of {KL_TYPES}, got {self.kl_loss_type!r}")
        need(self.kl_loss_coef >= 0, f"kl_loss_coef must be >= 0, got {self.kl_loss_coef}")
        need(
            self.use_kl_loss or self.kl_loss_coef == 0,
            f"kl_loss_coef={self.kl_loss_coef} needs use_kl_loss=True (it creates the reference model)",
        )
        need(self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        need(
            (self.loss_type == "custom_loss") == bool(self.custom_loss_function_path),
            "loss_type='custom_loss' and custom_loss_function_path go together",
        )
        need(self.loss_aggregation in ("token_mean", "sequence_mean"), "loss_aggregation: token_mean | sequence_mean")
        need(self.ratio_level in ("token", "sequence"), "ratio_level: token | sequence")
        need(self.ratio_correction in ("none", "tis", "clip_or_pop"), "ratio_correction: none | tis | clip_or_pop")
        need(self.fp8_scaling == "current" or self.precision == "fp8_block",
             f"fp8_scaling={self.fp8_scaling!r} needs precision='fp8_block', got {self.precision!r}")
        need(not self.nvfp4_stochastic_rounding or self.precision == "nvfp4",
             f"nvfp4_stochastic_rounding needs precision='nvfp4', got {self.precision!r}")
        need(self.fp8_amax_history_len >= 1 and self.fp8_margin >= 0
             and self.fp8_amax_compute_algo in ("max", "most_recent"),
             "need fp8_amax_history_len >= 1, fp8_margin >= 0, fp8_amax_compute_algo max | most_recent")
        need(0 <= self.tis_clip_low < self.tis_clip, f"need 0 <= tis_clip_low < tis_clip, got [{self.tis_clip_low}, {self.tis_clip}]")
        need(self.critic_lr is None or self.critic_lr > 0, f"critic_lr must be > 0, got {self.critic_lr}")
        need(self.value_clip > 0, f"value_clip must be > 0, got {self.value_clip}")
        need(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        need(self.logprob_chunk_size > 0, "logprob_chunk_size must be > 0")
        need(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        need(self.device in ("cpu", "cuda"), f"device must be 'cpu' or 'cuda', got {self.device!r}")
        need(self.offload_destination == "host" or self.offload_dir is not None,
             "offload_destination='disk' needs offload_dir")
        need(self.offload_staging_bytes > 0 and self.optimizer_bucket_bytes > 0,
             "offload_staging_bytes and optimizer_bucket_bytes must be > 0")
        need(self.optimizer_moment_dtype in DTYPES, "optimizer_moment_dtype: float32 | bfloat16")
        need(self.lora_rank >= 0, f"lora_rank must be >= 0 (0 = full-parameter training), got {self.lora_rank}")
        _ = self.lora  # validates alpha and target modules when LoRA is on

    @property
    def lora(self) -> LoraSettings | None:
        """The adapter's settings, or None for full-parameter training."""
        if not self.lora_rank:
            return None
        return LoraSettings(self.lora_rank, self.lora_alpha, self.lora_target_modules,
                            tuple(name for name, _ in self.lora_adapters))

    @property
    def needs_reference(self) -> bool:
        return self.use_kl_loss or self.kl_in_reward

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
