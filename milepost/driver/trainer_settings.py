"""The trainer's settings of a run: `TrainConfig` fields mapped one to one onto `TrainerSettings`.

Every trainer rank builds them the same way (driver/runtime.py); the objective's fields (issue 7)
and the precision contract's (milepost/lowprec/) are their own functions, so tests can check each.
"""

from __future__ import annotations

from milepost.config import TrainConfig
from milepost.train.settings import TrainerSettings


def trainer_settings(cfg: TrainConfig) -> TrainerSettings:
    """The run config's trainer fields, one to one."""
    return TrainerSettings(
        lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_iters=cfg.lr_warmup_iters,
        lr_decay_style=cfg.lr_decay_style,
        num_steps_total=cfg.num_rollout * cfg.optimizer_steps_per_rollout,
        weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad, global_batch_size=cfg.global_batch_size,
        max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
        activation_checkpointing=cfg.activation_checkpointing, compile_layers=cfg.compile_layers,
        fused_kernels=cfg.fused_kernels,
        separate_old_logprob_pass=cfg.separate_old_logprob_pass, eps_clip=cfg.eps_clip,
        enable_mtp_training=cfg.enable_mtp_training, mtp_loss_scaling_factor=cfg.mtp_loss_scaling_factor,
        eps_clip_high=cfg.eps_clip_high, use_kl_loss=cfg.use_kl_loss,
        kl_loss_coef=cfg.kl_loss_coef, kl_loss_type=cfg.kl_loss_type,
        entropy_coef=cfg.entropy_coef, temperature=cfg.rollout_temperature, seed=cfg.seed,
        offload_destination=cfg.offload_train_destination,
        offload_dir=None if cfg.offload_train_dir is None else str(cfg.offload_train_dir),
        offload_staging_bytes=cfg.offload_staging_bytes,
        actor_critic_turns=bool(cfg.offload_actor_for_critic),
        optimizer_state_dir=(str(cfg.optimizer_state_dir)
                             if cfg.stream_optimizer_state_to_disk else None),
        optimizer_bucket_bytes=cfg.optimizer_state_bucket_bytes,
        optimizer_moment_dtype=cfg.optimizer_moment_dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        dtype=cfg.dtype, device=cfg.device, true_on_policy=cfg.true_on_policy,
        opd_teacher_checkpoint=(None if cfg.opd_teacher_checkpoint is None
                                else str(cfg.opd_teacher_checkpoint)),
        lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
        lora_target_modules=cfg.lora_target_modules,
        lora_adapters=tuple((a["name"], float(a.get("lr", cfg.lr))) for a in cfg.adapters or []),
        **objective_settings(cfg), **precision_settings(cfg),
    )


def precision_settings(cfg: TrainConfig) -> dict:
    """The trainer's side of the precision contract (milepost/lowprec/)."""
    from milepost.lowprec.rules import run_contract

    contract = run_contract(cfg)
    return dict(precision=contract.train, precision_overrides=contract.overrides,
                nvfp4_four_over_six=cfg.nvfp4_four_over_six,
                nvfp4_dequantized_backward=cfg.nvfp4_dequantized_backward,
                nvfp4_stochastic_rounding=cfg.nvfp4_stochastic_rounding,
                fp8_scaling=cfg.fp8_scaling, fp8_amax_history_len=cfg.fp8_amax_history_len,
                fp8_amax_compute_algo=cfg.fp8_amax_compute_algo, fp8_margin=cfg.fp8_margin)


def objective_settings(cfg: TrainConfig) -> dict:
    """The objective's trainer fields (issue 7: estimators, losses, corrections, critic, R3)."""
    return dict(
        kl_in_reward=cfg.kl_coef > 0, loss_type=cfg.loss_type,
        custom_loss_function_path=cfg.custom_loss_function_path,
        loss_aggregation=cfg.loss_aggregation,
        ratio_level="sequence" if cfg.advantage_estimator == "gspo" else "token",
        ratio_correction=cfg.ratio_correction, tis_clip_low=cfg.tis_clip_low, tis_clip=cfg.tis_clip,
        critic_lr=cfg.critic_lr, value_clip=cfg.value_clip,
        critic_hf_checkpoint=None if cfg.critic_hf_checkpoint is None else str(cfg.critic_hf_checkpoint),
        use_rollout_routing_replay=cfg.use_rollout_routing_replay,
    )
