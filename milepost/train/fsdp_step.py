"""The pieces of `FSDPBackend.train_step` (milepost/train/fsdp.py): the behaviour policy's log-probs
and ratio-correction weights, one micro-batch's forward + backward (policy and critic), gradient
clipping, and the step's metrics reduced over the ranks.

Functions of an `FSDPBackend`, which owns the models, optimizers and settings; `train_step` calls
them in the order of the algorithm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from milepost.train import micro
from milepost.train.batch import TrainBatch
from milepost.train.corrections import CORRECTION_SUMS, sample_weights
from milepost.train.losses import METRIC_SUMS, value_loss
from milepost.train.mtp import mtp_loss
from milepost.train.optim import optimizer_step
from milepost.train.replay import RoutingProbe

if TYPE_CHECKING:
    from milepost.train.fsdp import FSDPBackend

Logprobs = list[torch.Tensor]  # per sample: [response_length] on CPU


def behaviour_logprobs(b: FSDPBackend, batch: TrainBatch, steps: list[list[int]],
                       plans: list[list[list[int]]]) -> tuple[Logprobs | None, bool]:
    """(old log-probs, in_forward): the batch's own, or the policy's before the first optimizer
    step; in_forward = the training forward itself gives them (returned as None)."""
    old = batch.old_logprobs
    # One optimizer step: the policy before it is the policy of the training forward itself,
    # so its detached log-probs are the old ones (no separate scoring pass).
    in_forward = (old is None and b.settings.loss_type != "sft_loss" and len(steps) == 1
                  and not b.settings.separate_old_logprob_pass)
    if old is None and b.settings.loss_type != "sft_loss" and not in_forward:
        # behaviour policy = the weights before this rollout's first optimizer step
        old = [torch.empty(0)] * len(batch)
        for step, plan in zip(steps, plans):
            sub = b._score(b.policy, batch.select(step), plan)
            for i, lp in zip(step, sub):
                old[i] = lp
    return old, in_forward


def correction_weights(b: FSDPBackend, batch: TrainBatch, old: Logprobs | None, in_forward: bool
                       ) -> tuple[Logprobs | None, list[float], torch.Tensor | None]:
    """(per-sample ratio-correction weights, their metric sums, in-forward accumulator).

    With in-forward old log-probs the weights and sums are computed per micro-batch instead:
    the accumulator gathers [correction sums..., sum |old - rollout|] over loss tokens."""
    if in_forward:
        weights, correction_sums = None, [0.0] * len(CORRECTION_SUMS)
        if b.correction.kind != "none" and batch.rollout_logprobs is None:
            sample_weights(None, None, batch.loss_masks, b.correction)  # raises, naming the setting
    else:
        weights, correction_sums = sample_weights(old, batch.rollout_logprobs, batch.loss_masks, b.correction)
    fused_acc = torch.zeros(len(CORRECTION_SUMS) + 1, dtype=torch.float64, device=b.device) if in_forward else None
    return weights, correction_sums, fused_acc


def policy_micro_step(b: FSDPBackend, batch: TrainBatch, mb: list[int], old: Logprobs | None,
                      ref: Logprobs | None, weights: Logprobs | None, denoms: Sequence[float],
                      probe: RoutingProbe | None, fused_acc: torch.Tensor | None = None) -> torch.Tensor:
    """Forward + backward of one micro-batch; returns [metric sums..., loss] (float64, detached).

    fused_acc set: the old log-probs are this forward's (detached); [correction sums...,
    sum |old - rollout|] over loss tokens are added to it.
    """
    forced, valid = b._forced(batch, mb)
    if probe is not None:
        probe.set_valid(valid)
    packed = micro.packed(batch, mb, b.device)
    b._route_adapters(batch, mb, packed)
    try:
        logp, entropy = b.policy.score(packed, forced)
        old_flat = weights_flat = None
        if fused_acc is not None:
            old_flat = logp.detach()
            weights_flat = micro.in_forward_old_metrics(batch, mb, old_flat, fused_acc, b.correction, b.device)
        lb = micro.loss_batch(batch, mb, logp, entropy, denoms, b.device, old=old, ref=ref, weights=weights,
                              old_flat=old_flat, weights_flat=weights_flat)
        loss, sums = b.loss_fn(lb, b.loss_settings)
        unknown = set(sums) - set(METRIC_SUMS)
        if unknown:
            raise ValueError(f"the loss returned metric sums {sorted(unknown)}; allowed: {METRIC_SUMS}")
        if b.policy.mtp_out is not None:  # --enable-mtp-training: the MTP layer's own term,
            out, b.policy.mtp_out = b.policy.mtp_out, None  # not in the reported loss
            mask = micro.cat(batch.loss_masks, mb, b.device)
            (loss + mtp_loss(out, mask, denoms[0], b.settings.mtp_loss_scaling_factor,
                             b._mtp_acc)).backward()
        else:
            loss.backward()
    except torch.OutOfMemoryError as err:
        raise torch.OutOfMemoryError(
            f"a micro-batch of {packed.num_tokens} tokens ({len(mb)} samples) ran out of device memory: "
            f"lower max_tokens_per_micro_batch (now {b.settings.max_tokens_per_micro_batch}) or set "
            f"activation_checkpointing='layer' (now {b.settings.activation_checkpointing!r}). {err}"
        ) from err
    if probe is not None:
        probe.flush()
    zero = torch.zeros((), device=b.device)
    return torch.stack([*(sums.get(k, zero).detach().to(b.device) for k in METRIC_SUMS), loss.detach()]).double()


def train_critic(b: FSDPBackend, batch: TrainBatch, steps: list[list[int]], plans: list[list[list[int]]],
                 denoms: list[list[float]]) -> torch.Tensor:
    """The critic's optimizer steps over the batch; returns [value_loss sum, value_clipfrac sum]."""
    b.residency.use("critic")
    sums = torch.zeros(2, dtype=torch.float64, device=b.device)
    for step, plan, denom in zip(steps, plans, denoms):
        for local in plan:
            sums += _critic_micro_step(b, batch, [step[j] for j in local], denom)
        norm = clip_gradients(b.critic.model.parameters(), b.settings.clip_grad)
        optimizer_step(b.critic.optimizer, b.critic.scheduler, norm)
    return sums


def _critic_micro_step(b: FSDPBackend, batch: TrainBatch, mb: list[int],
                       denoms: Sequence[float]) -> torch.Tensor:
    """Critic forward + backward of one micro-batch; returns [value_loss sum, value_clipfrac sum]."""
    forced, _ = b._forced(batch, mb)
    values = b.critic.model.values(micro.packed(batch, mb, b.device), forced)
    lb = micro.loss_batch(batch, mb, values, values, denoms, b.device, old=None, ref=None, weights=None)
    old_values, returns = micro.cat(batch.values, mb, b.device), micro.cat(batch.returns, mb, b.device)
    loss, sums = value_loss(values, old_values, returns, lb, b.loss_settings)
    loss.backward()
    return torch.stack([sums["value_loss"], sums["value_clipfrac"]]).double()


def clip_gradients(parameters: Iterable[nn.Parameter], clip: float) -> float:
    """Clip to global L2 norm `clip` (0: no clipping); returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    max_norm = clip if clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def step_metrics(b: FSDPBackend, batch: TrainBatch, *, acc: torch.Tensor, correction_sums: list[float],
                 fused_acc: torch.Tensor | None, old: Logprobs | None, in_forward: bool,
                 probe: RoutingProbe | None, loss_tokens: float, grad_norms: list[float], lr: float,
                 nonfinite: int, num_steps: int) -> dict[str, float]:
    """The step's metrics, summed over the ranks (collective) and divided per loss token.

    acc: [metric sums..., loss, value_loss sum, value_clipfrac sum] of this rank (float64)."""
    abs_diff = 0.0
    if fused_acc is not None:
        fused = fused_acc.tolist()
        if b.correction.kind != "none":
            correction_sums = fused[:-1]
        abs_diff = fused[-1]
    elif batch.rollout_logprobs is not None and old is not None:
        for o, r, m in zip(old, batch.rollout_logprobs, batch.loss_masks):
            abs_diff += float((o - r).abs()[m > 0].sum())
    n_tokens = float(sum(t.numel() for t in batch.tokens))
    r3 = [probe.tokens, probe.tokens_differing] if probe is not None else [0.0, 0.0]
    reduced = b._all_reduce(acc.tolist() + correction_sums + r3 + [abs_diff, n_tokens])
    per_token = max(loss_tokens, 1.0)
    n = len(METRIC_SUMS)
    metrics = {k: v / per_token for k, v in zip(METRIC_SUMS, reduced)}
    if b.settings.loss_type != "sft_loss":  # an RL run has no supervised term to report
        metrics.pop("sft_loss")
    metrics.update(
        loss=reduced[n] / num_steps,
        grad_norm=sum(grad_norms) / num_steps,
        lr=lr,
        tokens=reduced[-1],
        loss_tokens=loss_tokens,
        optimizer_steps=float(num_steps),
        skipped_steps=float(nonfinite),
    )
    if batch.returns is not None:
        metrics.update(value_loss=reduced[n + 1] / per_token, value_clipfrac=reduced[n + 2] / per_token)
    if b.correction.kind != "none":
        metrics.update({k: v / per_token for k, v in zip(CORRECTION_SUMS, reduced[n + 3 : n + 3 + len(CORRECTION_SUMS)])})
    if b.settings.enable_mtp_training:  # the MTP layer's mean cross-entropy (nats)
        ce, rows = b._all_reduce(b._mtp_acc.tolist())
        metrics["mtp_loss"] = ce / max(rows, 1.0)
    if probe is not None:
        tokens, differing = reduced[-4], reduced[-3]
        metrics["r3_routing_mismatch_frac"] = differing / max(tokens, 1.0)
    if batch.rollout_logprobs is not None and (old is not None or in_forward):
        metrics["train_rollout_logprob_abs_diff"] = reduced[-2] / per_token
    return metrics
