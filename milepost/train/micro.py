"""One micro-batch of a `TrainBatch` as model inputs and a `LossBatch` (flat response tokens).

A rank with no sample for a micro-batch its peers run gets the 2-token dummy (loss mask 0), so
every rank issues the same collectives. Routing replay: the samples' engine routings are packed
into forced expert ids; the dummy gets expert 0..k-1 (any valid ids: it trains nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from milepost.train.batch import TrainBatch
from milepost.train.corrections import CorrectionSettings, ratio_weights_on_device
from milepost.train.logprobs import PackedBatch, dummy_batch, pack
from milepost.train.losses import LossBatch
from milepost.train.replay import forced_for_pack, valid_rows


def packed(batch: TrainBatch, mb: Sequence[int], device: torch.device) -> PackedBatch:
    if not mb:
        return dummy_batch(device)
    return pack([batch.tokens[i] for i in mb], [batch.response_lengths[i] for i in mb], device)


def forced_experts(
    routed: Sequence[torch.Tensor] | None, mb: Sequence[int], layers: int, top_k: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(forced ids [T, layers, top_k] int64, rows with a real routing [T] bool), or (None, None)."""
    if routed is None:
        return None, None
    if not mb:
        ids = torch.arange(top_k, dtype=torch.int64).expand(2, layers, top_k).contiguous()
        return ids.to(device), torch.zeros(2, dtype=torch.bool)
    picked = [routed[i] for i in mb]
    return forced_for_pack(picked).to(device), valid_rows(picked)


def cat(values: Sequence[torch.Tensor] | None, mb: Sequence[int], device: torch.device) -> torch.Tensor | None:
    if values is None:
        return None
    if not mb:
        return torch.zeros(1, device=device)
    return torch.cat([values[i] for i in mb]).to(device, torch.float32)


def loss_batch(
    batch: TrainBatch,
    mb: Sequence[int],
    logp: torch.Tensor,
    entropy: torch.Tensor,
    denoms: tuple[float, float],
    device: torch.device,
    *,
    old: Sequence[torch.Tensor] | None,
    ref: Sequence[torch.Tensor] | None,
    weights: Sequence[torch.Tensor] | None,
    old_flat: torch.Tensor | None = None,
    weights_flat: torch.Tensor | None = None,
) -> LossBatch:
    """The `LossBatch` of micro-batch `mb` (local sample indices) given the policy's logp/entropy.

    old_flat / weights_flat: this micro-batch's old log-probs / ratio weights already flat on the
    device (computed inside the training forward); they take the place of `old` / `weights`.
    """
    lengths = [batch.response_lengths[i] for i in mb] or [1]
    seq_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    return LossBatch(
        logp=logp,
        entropy=entropy,
        loss_mask=cat(batch.loss_masks, mb, device),  # zeros for the dummy: it trains nothing
        seq_index=seq_index,
        num_seqs=len(lengths),
        token_denom=max(denoms[0], 1.0),
        seq_denom=max(denoms[1], 1.0),
        advantages=cat(batch.advantages, mb, device),
        old_logp=old_flat if old_flat is not None else cat(old, mb, device),
        ref_logp=cat(ref, mb, device),
        weights=weights_flat if weights_flat is not None else cat(weights, mb, device),
    )


def in_forward_old_metrics(
    batch: TrainBatch, mb: Sequence[int], old_flat: torch.Tensor, acc: torch.Tensor,
    correction: CorrectionSettings, device: torch.device,
) -> torch.Tensor | None:
    """Ratio-correction weights [N] of a micro-batch whose old log-probs are `old_flat` (the
    training forward's, detached), or None when off; adds its CORRECTION_SUMS and
    sum |old - rollout| over loss tokens to `acc` ([len(CORRECTION_SUMS) + 1] float64)."""
    if batch.rollout_logprobs is None:
        return None
    rollout = cat(batch.rollout_logprobs, mb, device)
    mask = cat(batch.loss_masks, mb, device)
    acc[-1] += torch.where(mask > 0, (old_flat - rollout).abs(), torch.zeros_like(rollout)).sum().double()
    if correction.kind == "none":
        return None
    weights, sums = ratio_weights_on_device(old_flat, rollout, mask, correction)
    acc[:-1] += sums
    return weights
