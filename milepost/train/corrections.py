"""Train–rollout ratio corrections (report 3.4): TIS and clip-or-pop, as per-token loss weights.

r = exp(logp_train_old - logp_rollout) per response token: the trainer's log-prob of the sampled
token (before this rollout's first optimizer step) over the engine's. TIS uses clamp(r, low, high)
as the token's weight on its policy-gradient loss (an extreme token is damped); clip-or-pop uses r
inside [low, high] and 0 outside (an outlier token is dropped, as loss-masking would). Both report
the pre-clamp ratio, the clipped fraction and the mean |r - 1| over loss tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

CORRECTIONS = ("none", "tis", "clip_or_pop")
# Sums over loss tokens; divided by the loss-token count they become train/<name> metrics.
CORRECTION_SUMS = ("rollout_ratio", "rollout_ratio_clipfrac", "rollout_ratio_abs_dev")


@dataclass(frozen=True)
class CorrectionSettings:
    """kind: none | tis | clip_or_pop. low / high: the interval (defaults [0, 2]: only the upper
    tail acts, since a ratio is never below 0)."""

    kind: Literal["none", "tis", "clip_or_pop"] = "none"
    low: float = 0.0
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in CORRECTIONS:
            raise ValueError(f"ratio correction must be one of {CORRECTIONS}, got {self.kind!r}")
        if not 0.0 <= self.low < self.high:
            raise ValueError(f"need 0 <= tis_clip_low ({self.low}) < tis_clip ({self.high})")


def ratio_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor, settings: CorrectionSettings
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights [N] and metric sums over loss tokens (CORRECTION_SUMS) for flat [N] inputs.

    Computed in float64 (the exp of a log-prob difference), returned as float32. Masked tokens get
    weight 0 and count in no metric.
    """
    weights, sums = ratio_weights_on_device(old_logp, rollout_logp, loss_mask, settings)
    return weights, dict(zip(CORRECTION_SUMS, sums.tolist()))


def ratio_weights_on_device(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, loss_mask: torch.Tensor, settings: CorrectionSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ratio_weights` with the sums as a float64 tensor [len(CORRECTION_SUMS)] on the inputs'
    device (no host sync: the trainer calls it once per micro-batch)."""
    keep = loss_mask > 0
    ratio = torch.exp(old_logp.double() - rollout_logp.double())
    outside = (ratio < settings.low) | (ratio > settings.high)
    if settings.kind == "tis":
        weights = ratio.clamp(settings.low, settings.high)
    elif settings.kind == "clip_or_pop":
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)
    else:
        weights = torch.ones_like(ratio)
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    zero = torch.zeros_like(ratio)
    sums = torch.stack([
        torch.where(keep, ratio, zero).sum(),
        (outside & keep).double().sum(),
        torch.where(keep, (ratio - 1.0).abs(), zero).sum(),
    ])
    return weights.float(), sums


def sample_weights(
    old: list[torch.Tensor] | None,
    rollout: list[torch.Tensor] | None,
    masks: list[torch.Tensor],
    settings: CorrectionSettings,
) -> tuple[list[torch.Tensor] | None, list[float]]:
    """Per-sample weights ([response_length] each) and CORRECTION_SUMS; (None, zeros) when off."""
    if settings.kind == "none":
        return None, [0.0] * len(CORRECTION_SUMS)
    if rollout is None or old is None:
        raise ValueError(f"--ratio-correction {settings.kind} needs the engine's log-probs in the batch")
    weights, sums = ratio_weights(torch.cat(old), torch.cat(rollout), torch.cat(masks), settings)
    return list(weights.split([m.numel() for m in masks])), [sums[k] for k in CORRECTION_SUMS]
