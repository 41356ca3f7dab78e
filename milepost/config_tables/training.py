"""How the trainer learns and publishes: objective, optimizer, checkpoints, weight updates, logging, distillation, LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from milepost.config_tables.base import MIB, Table


class AlgorithmTable(Table):
    advantage_estimator: str = Field(
        "grpo",
        description="How rewards become advantages: grpo, gspo (sequence-level ratio), "
        "reinforce_plus_plus, reinforce_plus_plus_baseline, ppo (GAE over a learned critic; needs "
        "--critic-lr), or an import path module.sub:function taking (samples, settings, inputs).",
    )
    normalize_advantages: bool = Field(
        True,
        description="grpo/gspo: divide each group's centered rewards by the group's std; "
        "reinforce++/ppo: whiten advantages over the rollout's loss tokens.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of per-token rewards (ppo, reinforce++).")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo).")
    critic_lr: float | None = Field(
        None, gt=0, description="Learning rate of the PPO critic (a value model trained in the same ranks); "
        "required by --advantage-estimator ppo."
    )
    critic_hf_checkpoint: Path | None = Field(
        None, description="Hugging Face directory the critic starts from; default the policy's --hf-checkpoint."
    )
    value_clip: float = Field(0.2, gt=0, description="Critic loss: clip range of the value around its old value.")
    kl_coef: float = Field(
        0.0, ge=0, description="KL-to-reference penalty folded into per-token rewards (reinforce++, ppo); "
        "uses --kl-loss-type."
    )
    loss_type: Literal["policy_loss", "custom_loss"] = Field(
        "policy_loss", description="policy_loss (PPO-clip / GSPO) or custom_loss (--custom-loss-function-path)."
    )
    custom_loss_function_path: str | None = Field(
        None, description="A loss module.sub:function(batch: LossBatch, settings: LossSettings) -> (loss, sums)."
    )
    loss_aggregation: Literal["token_mean", "sequence_mean"] | None = Field(
        None, description="token_mean (over all loss tokens of a step) or sequence_mean (each response's "
        "token mean, averaged); default sequence_mean for gspo, else token_mean."
    )
    ratio_correction: Literal["none", "tis", "clip_or_pop"] = Field(
        "none", description="Train-rollout mismatch correction on r = exp(logp_train - logp_rollout): "
        "tis clamps r to [--tis-clip-low, --tis-clip] as a per-token weight; clip_or_pop drops tokens outside."
    )
    tis_clip_low: float = Field(0.0, ge=0, description="Lower end of the ratio-correction interval.")
    tis_clip: float = Field(2.0, gt=0, description="Upper end of the ratio-correction interval.")
    use_rollout_routing_replay: bool = Field(
        False, description="R3: the trainer's MoE layers use the experts the engine routed each token to."
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range below: ratio >= 1 - eps_clip.")
    eps_clip_high: float = Field(0.28, gt=0, description="PPO clip range above: ratio <= 1 + eps_clip_high.")
    use_kl_loss: bool = Field(False, description="Add a KL loss to the reference (initial) policy.")
    kl_loss_coef: float = Field(0.0, ge=0, description="Weight of the KL loss (needs --use-kl-loss).")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3", description="KL estimator (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10])."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    use_rollout_logprobs: bool | None = Field(
        None,
        description="Use the engine's log-probs as the old policy instead of recomputing them; "
        "default: on under --fully-async without a --ratio-correction (the PPO ratio is then "
        "taken against the weights that generated the group, however stale), else off.",
    )


class OptimizerTable(Table):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (Adam).")
    min_lr: float = Field(0.0, ge=0, description="Final learning rate of the cosine decay.")
    lr_warmup_iters: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    lr_decay_style: Literal["constant", "cosine"] = Field(
        "constant", description="Learning rate after warmup; cosine decays to --min-lr over the run."
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW).")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.98, ge=0, lt=1, description="Adam beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    clip_grad: float = Field(1.0, ge=0, description="Max global gradient norm; 0 = no clipping.")
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step; default rollout_batch_size * "
        "n_samples_per_prompt (one step per rollout).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Token budget of one micro-batch of a trainer rank (dynamic batching); default "
        "16384 on CUDA (one 16k-token micro-batch instead of two of 8k nearly halved a Qwen3-0.6B "
        "step on the H200: docs/training_speed.md), 4096 on CPU.",
        json_schema_extra={"flags": ["--max-tokens-per-gpu"]},
    )
    activation_checkpointing: Literal["none", "layer"] = Field(
        "none",
        description="Trainer activations: 'none' keeps every layer's for backward (fastest where it "
        "fits: measured on the H200, docs/training_speed.md); 'layer' recomputes each decoder layer "
        "in backward (less memory, ~30% slower on the Qwen3-0.6B shape).",
    )
    compile_layers: bool = Field(
        False,
        description="torch.compile each decoder layer's forward (dense models; attention stays eager). "
        "Opt-in: slower than eager layers on the H200 (docs/training_speed.md); refused with "
        "--activation-checkpointing layer.",
    )
    fused_kernels: bool = Field(
        True,
        description="On CUDA, the trainer's Triton kernels with backward: RMSNorm, RoPE, SiLU-and-mul, "
        "LM-head log-prob + entropy without fp32 [tokens, vocab] logits, grouped-GEMM MoE experts "
        "(docs/training_speed.md); off = the torch ops. No effect on CPU.",
    )
    separate_old_logprob_pass: bool = Field(
        False,
        description="Score the old policy in its own no-grad pass even with one optimizer step per "
        "rollout (by default the training forward's own log-probs, detached, are the old policy's).",
    )
    enable_mtp_training: bool = Field(
        False,
        description="Train the checkpoint's multi-token-prediction layer (the NEXTN draft) on the "
        "rollout tokens beside the policy loss: inputs detached and clipped apart, so the policy's "
        "update is unchanged (docs/speculative.md). Off: the MTP layer is kept as loaded and still "
        "sent to the engines with every update.",
    )
    mtp_loss_scaling_factor: float = Field(
        0.1, ge=0, description="--enable-mtp-training: weight of the MTP layer's cross-entropy, "
        "normalized like the policy loss (per loss token).",
    )


class CheckpointTable(Table):
    run_dir: Path | None = Field(
        None,
        description="Directory of this run (checkpoints, metrics, logs); default "
        "runs/<recipe name>-<timestamp>.",
    )
    save_interval: int = Field(0, ge=0, description="Save a checkpoint every N steps; 0 = only at the end.")
    resume: str = Field(
        "auto",
        description="auto = continue from the latest checkpoint in --run-dir if any; never; "
        "or the path of a checkpoint.",
    )
    save_hf_at_end: bool = Field(True, description="Write the final weights as a Hugging Face directory.")


class WeightsTable(Table):
    update_weight_buffer_size: int = Field(
        512 * MIB, ge=MIB, description="Bytes per weight-update bucket (trainer to engines)."
    )
    update_weights_interval: int = Field(1, ge=1, description="Push weights to the engines every N steps.")
    update_weight_transfer_mode: Literal["tensor", "broadcast", "p2p", "disk-delta"] | None = Field(
        None,
        description="tensor = in-host handoff; broadcast = one torch.distributed group to every "
        "engine; p2p = point-to-point writes per engine (transfer plan, one staging buffer); "
        "disk-delta = changed bytes published to --update-weight-delta-dir (report 4.3). "
        "Default: tensor when colocated, else broadcast.",
    )
    update_weight_delta_dir: Path | None = Field(
        None,
        description="disk-delta: the version store, a directory trainer and engines both see at "
        "the same path; default <run_dir>/weight_deltas.",
    )
    update_weight_delta_encoding: Literal["xor", "overwrite"] = Field(
        "xor",
        description="disk-delta: xor (compact; applied exactly once on its declared base) or "
        "overwrite (changed positions + new values; idempotent).",
    )
    check_weight_update: bool = Field(
        False, description="After each update, verify the engines hold exactly the trainer's weights."
    )
    check_weight_update_equal: bool = Field(
        False,
        description="Once, at the first update: fill every engine tensor with noise, update, then "
        "require every engine tensor to equal the trainer's bit for bit (report 4.4).",
    )
    check_weight_update_equal_skip: list[str] | None = Field(
        None,
        description="--check-weight-update-equal: engine tensor names (globs, e.g. '*.k_scale') "
        "that live only on the rollout side and are not compared; '!glob' compares only the "
        "names matching it.",
    )
    check_weight_update_selector: Literal["all", "target", "draft"] = Field(
        "all",
        description="--check-weight-update-equal: which model the check covers (Miles' name): all, "
        "target (skips the MTP draft's layers), or draft (only the layers multi-token prediction "
        "adds, model.layers.{num_hidden_layers + i}.*; report 4.4).",
    )


class LoggingTable(Table):
    use_tensorboard: bool = Field(False, description="Also log metrics to TensorBoard (run_dir/tensorboard).")
    use_wandb: bool = Field(
        False, description="Also log metrics to Weights & Biases, offline mode (run_dir/wandb)."
    )
    wandb_project: str = Field("milepost", description="W&B project name.")
    log_interval: int = Field(1, ge=1, description="Log metrics every N steps.")


class OpdTable(Table):
    """On-policy distillation (report 5.2; docs/distillation.md): a teacher's per-token signal."""

    opd_teacher_url: str | None = Field(
        None, description="Served teacher (any SGLang-protocol server sharing the student's "
        "tokenizer): scores every finished trajectory during rollout.")
    opd_teacher_checkpoint: Path | None = Field(
        None, description="In-process teacher: a Hugging Face directory of the student's "
        "architecture, loaded in the trainer ranks and scoring each batch in the train step.")
    teachers: list[dict[str, str]] | None = Field(
        None, description="Several served teachers, [[opd.teachers]] url = ..., tag = ...: a "
        "prompt goes to the teacher whose tag its metadata.teacher names.",
        json_schema_extra={"flags": ["--opd-teachers"]})
    opd_coef: float | None = Field(
        None, gt=0, description="Scale of the reverse-KL estimate subtracted from each token's "
        "advantage; default 1.0 with a teacher.")
    opd_task_reward: bool = Field(
        True, description="With a teacher: keep the task reward in the advantages; off "
        "(--no-opd-task-reward) distils alone (rewards are still computed and logged).")
    opd_top_k: int = Field(
        0, ge=0, description="Served teacher: score K candidates per position (0 = the sampled "
        "token only); the estimate is their student-probability-weighted difference.")
    opd_top_k_set: Literal["student", "intersection"] = Field(
        "student", description="--opd-top-k candidates: the student's top-K, or its intersection "
        "with the teacher's top-K (the sampled token where it is empty).")
    opd_teacher_timeout_s: float = Field(
        300.0, gt=0, description="Served teacher: time limit of one scoring request.")
    opd_teacher_retries: int = Field(
        2, ge=0, description="Served teacher: retries of a failed scoring request before the "
        "group is given up (its prompt retried later, counted in opd/teacher_failed_groups).")


class LoraTable(Table):
    """LoRA RL (report 5.1; docs/lora.md): train an adapter on the frozen base; engines serve it."""

    lora_rank: int = Field(
        0, ge=0, description="Rank r of the adapter (A [r, in], B [out, r]); 0 = full-parameter "
        "training.")
    lora_alpha: float = Field(
        16.0, gt=0, description="The adapter's update is B A * alpha / r (PEFT's lora_alpha).")
    lora_target_modules: str = Field(
        "all-linear", description="Projections that get an adapter, comma-separated (q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or all-linear.")
    adapters: list[dict[str, Any]] | None = Field(
        None, description="Multi-LoRA: several adapters trained at once, [[lora.adapters]] name = ..., "
        "prompt_data = ..., reward_fn = ... (default: reward_fn), lr = ... (default: lr), "
        "eval_prompt_data = ... (optional: eval/<name>/...); each request names its prompt's "
        "adapter (docs/lora.md).",
        json_schema_extra={"flags": ["--lora-adapters"]})
