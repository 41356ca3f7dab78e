"""The RL policy objective: PPO-clip + optional KL to a reference model − entropy bonus.

All terms are per token over flat [N] tensors of response tokens. Aggregation is the token mean over
the loss-mask tokens of the whole global batch (one optimizer step over all ranks): each rank sums
its tokens and divides by the global count `denom`, so the data-parallel sum of gradients is the
global mean. (Sequence-mean aggregation comes with GSPO.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Sums the backend all-reduces; divided by the global loss-token count they become the metrics.
METRIC_SUMS = ("pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy")


@dataclass(frozen=True)
class PolicyLossSettings:
    """eps_clip / eps_clip_high: ratio clip range [1 - low, 1 + high].
    kl_loss_coef / kl_loss_type: KL-to-reference penalty (k1 | k2 | k3); used when ref log-probs are given.
    entropy_coef: entropy bonus weight."""

    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0


def ppo_clip(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss, clipped flag and approximate KL; all [N].

    ratio = exp(logp - old_logp); loss = max(-A * ratio, -A * clamp(ratio, 1 - low, 1 + high)).
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float(), -log_ratio.detach()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Schulman's estimators of KL(pi || ref) per token from samples of pi: [N].

    k1 = log(pi/ref); k2 = (log(pi/ref))^2 / 2; k3 = ref/pi - 1 - log(ref/pi) (unbiased, >= 0).
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"kl_loss_type must be 'k1', 'k2' or 'k3', got {kind!r}")


def policy_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    denom: float,
    settings: PolicyLossSettings,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective of one micro-batch as its share of the global token mean, and metric sums.

    logp, entropy: [N] with grad; old_logp, advantages, loss_mask (0/1), ref_logp: [N].
    denom: loss-mask tokens of the whole optimizer step over all ranks (>= 1).
    Returns (loss scalar to backpropagate, {name: detached sum over this micro-batch's loss tokens}).
    Masked tokens contribute nothing to the loss or the metrics.
    """
    keep = loss_mask > 0

    def masked_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, x, torch.zeros_like(x)).sum()

    pg, clipped, approx_kl = ppo_clip(logp, old_logp, advantages, settings.eps_clip, settings.eps_clip_high)
    pg_sum, ent_sum = masked_sum(pg), masked_sum(entropy)
    total = pg_sum - settings.entropy_coef * ent_sum
    kl_sum = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None:
        kl_sum = masked_sum(kl_estimate(logp, ref_logp, settings.kl_loss_type))
        if settings.kl_loss_coef:
            total = total + settings.kl_loss_coef * kl_sum
    sums = {
        "pg_loss": pg_sum.detach(),
        "pg_clipfrac": masked_sum(clipped),
        "ppo_kl": masked_sum(approx_kl),
        "kl": kl_sum.detach(),
        "entropy": ent_sum.detach(),
    }
    return total / denom, sums
