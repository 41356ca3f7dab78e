"""From a rollout's samples to this rank's `TrainBatch`: what the trainer must score first, then the
advantage estimator over the whole rollout (groups and whitening span every rank's samples).

Before estimating, each rank scores only its own share: critic values (ppo) and, with a KL reward
penalty (--kl-coef), policy and reference log-probs; the shares are all-gathered so every rank runs
the estimator on the full rollout and gets the same advantages.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from milepost.config import TrainConfig
from milepost.opd_rules import opd_enabled
from milepost.train.advantages import AdvantageInputs, AdvantageSettings, estimate
from milepost.train.batch import TrainBatch, split_for_rank
from milepost.train.fsdp import FSDPBackend
from milepost.train.distill import apply_opd, distill_stats, sample_signal
from milepost.train.losses import kl_estimate
from milepost.types import Sample


def advantage_settings(cfg: TrainConfig) -> AdvantageSettings:
    return AdvantageSettings(normalize_std=cfg.normalize_advantages, gamma=cfg.gamma, lambd=cfg.lambd,
                             kl_coef=cfg.kl_coef)


def loss_mask_of(s: Sample) -> torch.Tensor:
    """The sample's loss mask as float32 [response_length]; empty means all ones."""
    if s.loss_mask:
        return torch.as_tensor(s.loss_mask, dtype=torch.float32)
    return torch.ones(s.response_length, dtype=torch.float32)


def gather_shares(mine: list[int], local: list[torch.Tensor], total: int) -> list[torch.Tensor]:
    """Every rank's per-sample tensors, placed at their indices in the rollout (a collective)."""
    shares: list = [(mine, local)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, (mine, local))
    out: list[torch.Tensor | None] = [None] * total
    for indices, tensors in shares:
        for i, t in zip(indices, tensors):
            out[i] = t
    return out  # type: ignore[return-value]


def rank_batch(cfg: TrainConfig, backend: FSDPBackend, samples: Sequence[Sample], rank: int, world: int,
               metrics: dict[str, float] | None = None) -> TrainBatch:
    """This rank's TrainBatch of the rollout `samples` (all ranks call it: it runs collectives).
    With a distillation teacher, `metrics` receives the `opd/*` numbers."""
    mine = split_for_rank(samples, rank, world, cfg.global_batch_size)
    local = [samples[i] for i in mine]
    inputs = AdvantageInputs(loss_masks=[loss_mask_of(s) for s in samples])
    old = ref = values = None
    if cfg.kl_coef > 0:  # KL penalty in the reward: the behaviour policy against the reference
        old = backend.compute_logprobs(local)
        ref = backend.compute_logprobs(local, reference=True)
        kl = [kl_estimate(o, r, cfg.kl_loss_type) for o, r in zip(old, ref)]
        inputs.kl = gather_shares(mine, kl, len(samples))
    if backend.critic is not None:
        values = backend.compute_values(local)
        inputs.values = gather_shares(mine, values, len(samples))
    distill = opd_enabled(cfg)
    if distill and backend.teacher is not None:  # in-process teacher: its own forward, this step
        t0 = time.perf_counter()
        teacher = gather_shares(mine, backend.compute_logprobs(local, teacher=True), len(samples))
        for s, t in zip(samples, teacher):
            s.teacher_logprobs = t.tolist()
        if metrics is not None:
            metrics["opd/teacher_time"] = time.perf_counter() - t0
    scored = samples
    if distill and not cfg.opd_task_reward:  # distil alone: the estimator sees reward 0
        scored = [dataclasses.replace(s, reward=0.0) for s in samples]
    adv = estimate(cfg.advantage_estimator, scored, advantage_settings(cfg), inputs)
    if distill:  # report 5.2: subtracted after the estimator, a dense per-token reward
        signals = [sample_signal(s) for s in samples]
        adv.advantages = apply_opd(adv.advantages, signals, inputs.loss_masks, float(cfg.opd_coef))
        if metrics is not None:
            stats = distill_stats(samples, signals, inputs.loss_masks)
            metrics.update({f"opd/{k}": v for k, v in stats.metrics().items()})
    batch = TrainBatch.from_samples(
        local, [adv.advantages[i] for i in mine], old_logprobs=old, ref_logprobs=ref, values=values,
        returns=None if adv.returns is None or values is None else [adv.returns[i] for i in mine],
        routed_experts=backend.routed_experts_of(local))
    if cfg.use_rollout_logprobs:
        batch.old_logprobs = batch.rollout_logprobs
    return batch
