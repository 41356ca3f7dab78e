"""Refusals for the loop's shape: evaluation, the fully-async flags, and the objective."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from milepost.config_rules_parts import checkpoint_has_native_routing, is_moe_checkpoint

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def eval_refusals(c: TrainConfig) -> list[str]:
    """Evaluation runs on the rollout engines right after a weight update, so it needs both."""
    if c.eval_interval == 0:
        return ([f"--eval-prompt-data {c.eval_prompt_data} is set but --eval-interval is 0, so it "
                 "would never be used; set --eval-interval N or drop --eval-prompt-data"]
                if c.eval_prompt_data is not None else [])
    p: list[str] = []
    if c.eval_prompt_data is None and not any("eval_prompt_data" in a for a in c.adapters or []):
        # multi-LoRA: each [[lora.adapters]] entry may name its own (milepost/lora/rules.py)
        p.append(f"--eval-interval {c.eval_interval} needs --eval-prompt-data (the held-out prompts)")
    if c.load_rollouts is not None or c.rollout_only:
        p.append("--eval-interval needs engines and a policy that trains; it cannot be used with "
                 "--load-rollouts (no engines) or --rollout-only (no updates to evaluate)")
    if c.eval_interval % c.update_weights_interval:
        p.append(f"--eval-interval {c.eval_interval} must be a multiple of "
                 f"--update-weights-interval {c.update_weights_interval}: an evaluation measures "
                 "the weights just sent to the engines")
    return p


_ASYNC_ONLY = ("max_inflight", "rollout_granularity", "buffer_class", "max_staleness", "group_filter")


def fully_async_refusals(c: TrainConfig) -> list[str]:
    """Fully asynchronous RL (report 2.2): its placement, buffer and staleness settings."""
    from milepost.config_tables import IMPORT_PATH

    p: list[str] = []
    if c.eval_mode == "external" and (c.eval_backend is None or c.eval_interval == 0):
        p.append("--eval-mode external needs --eval-backend module.sub:Class and --eval-interval N")
    if c.eval_backend is not None and c.eval_mode != "external":
        p.append("--eval-backend is only used with --eval-mode external; add it or drop --eval-backend")
    if c.eval_mode == "dedicated" and c.device == "cuda":
        p.append("--eval-mode dedicated runs its engines on CPU only for now; use --eval-mode "
                 "shared or external on GPUs")
    if c.eval_backend is not None and not IMPORT_PATH.match(c.eval_backend):
        p.append(f"--eval-backend {c.eval_backend!r} is not an import path module.sub:Class")
    if not c.fully_async:
        given = [name for name in _ASYNC_ONLY if getattr(c, name) is not None]
        if c.eval_mode != "shared":
            given.append(f"eval_mode {c.eval_mode}")
        return p + ([f"--{given[0].replace('_', '-')} only applies to --fully-async runs; add "
                     "--fully-async or drop it"] if given else [])
    if c.deterministic:
        p.append("--deterministic needs the synchronous loop: under --fully-async which groups are "
                 "trained depends on timing; drop one of them")
    if c.colocate:
        p.append("--fully-async generates while the trainer trains, so trainer and engines need "
                 "devices of their own; it is refused with --colocate (drop one of them)")
    if c.load_rollouts is not None or c.rollout_only:
        p.append("--fully-async needs live engines and a trainer; it cannot be used with "
                 "--load-rollouts or --rollout-only")
    if c.save_rollouts is not None:
        p.append("--save-rollouts is not supported with --fully-async yet; drop one of them")
    if c.max_staleness is not None and c.max_staleness < 0:
        p.append(f"--max-staleness {c.max_staleness} is negative; use 0 (on-policy), a positive "
                 "number of weight versions, or leave it unset (no limit)")
    capacity = int(c.buffer_capacity_factor * c.rollout_batch_size)
    if capacity < c.rollout_batch_size:
        p.append(f"--buffer-capacity-factor {c.buffer_capacity_factor} gives a buffer of {capacity} "
                 f"groups, smaller than one train batch (--rollout-batch-size "
                 f"{c.rollout_batch_size}): no step could ever take its batch; use a factor >= 1")
    if c.max_inflight is not None and c.max_inflight < c.n_samples_per_prompt:
        p.append(f"--max-inflight {c.max_inflight} is below --n-samples-per-prompt "
                 f"{c.n_samples_per_prompt}: no group could ever start; raise it")
    for name in ("buffer_class", "group_filter"):
        path = getattr(c, name)
        if path is not None and not IMPORT_PATH.match(path):
            p.append(f"--{name.replace('_', '-')} {path!r} is not an import path module.sub:name")
    return p


GROUP_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")
SCALAR_ESTIMATORS = ("grpo", "gspo")


def objective_refusals(c: TrainConfig) -> list[str]:
    """Estimator, critic, loss plug-in, KL, ratio-correction and R3 combinations (issue 7)."""
    p: list[str] = []
    est = c.advantage_estimator
    if est in GROUP_ESTIMATORS and c.n_samples_per_prompt < 2:
        p.append(f"--advantage-estimator {est} compares the samples of one prompt; --n-samples-per-prompt "
                 "must be >= 2")
    if est == "ppo" and c.critic_lr is None:
        p.append("--advantage-estimator ppo needs a learned value function: set --critic-lr (and optionally "
                 "--critic-hf-checkpoint, --value-clip, --gamma, --lambd)")
    if est != "ppo" and (c.critic_lr is not None or c.critic_hf_checkpoint is not None):
        p.append(f"--critic-lr / --critic-hf-checkpoint train a critic only for --advantage-estimator ppo "
                 f"(got {est}); drop them or use ppo")
    if c.offload_actor_for_critic and est != "ppo":
        p.append(f"--offload-actor-for-critic takes the actor off the device while a critic works; "
                 f"--advantage-estimator {est} has no critic: drop it or use ppo")
    if c.kl_coef > 0 and est in SCALAR_ESTIMATORS:
        p.append(f"--kl-coef puts a per-token KL penalty into the rewards, which {est} (one advantage per "
                 "sequence) cannot carry; use --use-kl-loss --kl-loss-coef instead")
    if (c.loss_type == "custom_loss") != (c.custom_loss_function_path is not None):
        p.append("--loss-type custom_loss and --custom-loss-function-path go together: set both or neither")
    elif c.custom_loss_function_path is not None:
        p += _plugin_refusal("milepost.train.losses", "get_loss", "custom_loss", c.custom_loss_function_path)
    if ":" in est:
        p += _plugin_refusal("milepost.train.advantages", "get_estimator", est)
    if c.tis_clip_low >= c.tis_clip:
        p.append(f"--tis-clip-low ({c.tis_clip_low}) must be below --tis-clip ({c.tis_clip})")
    if c.ratio_correction != "none" and c.use_rollout_logprobs:
        p.append(f"--ratio-correction {c.ratio_correction} weighs exp(trainer - rollout log-prob), which "
                 "--use-rollout-logprobs makes identically 1; drop one of them")
    if c.use_rollout_routing_replay and not is_moe_checkpoint(c.hf_checkpoint):
        p.append(f"--use-rollout-routing-replay: {c.hf_checkpoint} is a dense model (no expert routing to "
                 "replay); turn it off or train a mixture-of-experts model")
    elif c.use_rollout_routing_replay and not checkpoint_has_native_routing(c.hf_checkpoint):
        p.append(f"--use-rollout-routing-replay: {c.hf_checkpoint} runs on the transformers fallback, "
                 "which records and replays no expert routing (docs/models.md); turn it off or train a "
                 "natively supported MoE (see `milepost models`)")
    if c.use_rollout_routing_replay and c.critic_hf_checkpoint not in (None, c.hf_checkpoint):
        p.append("--use-rollout-routing-replay replays the policy's expert ids, which a critic from another "
                 "--critic-hf-checkpoint cannot take; drop --critic-hf-checkpoint (the critic then starts "
                 "from --hf-checkpoint)")
    return p


def _plugin_refusal(module: str, getter: str, *args: str) -> list[str]:
    """Load a plug-in the way the trainer will (torch imported only here); its error, or nothing."""
    try:
        getattr(importlib.import_module(module), getter)(*args)
    except ValueError as e:
        return [str(e)]
    return []


