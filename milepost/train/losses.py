"""The typed loss interface (report 3.4): one protocol, policy / value / supervised variants, a user hook.

A loss is `fn(batch: LossBatch, settings: LossSettings) -> (loss, sums)`: `loss` is this micro-batch's
share of the optimizer step's objective (so summing over micro-batches and data-parallel ranks gives
the whole objective), `sums` are detached metric sums over its loss tokens (keys from METRIC_SUMS).

Aggregation (`LossSettings.aggregation`): "token_mean" = sum over every loss token of the step / the
step's loss-token count (long responses weigh more); "sequence_mean" = each sequence's token mean,
averaged over the step's sequences (every response weighs the same; GSPO's default). Masked tokens
never count. Metrics are always per loss token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from milepost.plugins import load_callable

# Sums the backend all-reduces; divided by the global loss-token count they become the metrics.
METRIC_SUMS = ("pg_loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "sft_loss")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
AGGREGATIONS = ("token_mean", "sequence_mean")


@dataclass
class LossBatch:
    """One micro-batch of response tokens, flat [N] (N = response tokens of its sequences, in order).

    logp, entropy: the policy's, with grad. loss_mask: 0/1. seq_index: int64, which sequence
    (0..num_seqs-1) each token belongs to. token_denom / seq_denom: loss tokens / sequences with a
    loss token in the whole optimizer step over all ranks (each >= 1).
    Optional: advantages, old_logp (behaviour policy), ref_logp (reference model), weights
    (per-token ratio-correction weights, TIS / clip-or-pop; None = 1).
    """

    logp: torch.Tensor
    entropy: torch.Tensor
    loss_mask: torch.Tensor
    seq_index: torch.Tensor
    num_seqs: int
    token_denom: float
    seq_denom: float
    advantages: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    weights: torch.Tensor | None = None


@dataclass(frozen=True)
class LossSettings:
    """eps_clip / eps_clip_high: ratio clip range [1 - low, 1 + high].
    ratio_level: "token" (PPO/GRPO) or "sequence" (GSPO: exp of the sequence's mean log-ratio).
    aggregation: "token_mean" | "sequence_mean" (see the module docstring).
    kl_loss_coef / kl_loss_type: KL-to-reference loss (k1 | k2 | k3 | low_var_kl) when ref log-probs exist.
    entropy_coef: entropy bonus weight (subtracted).
    value_clip: critic loss clip range around the old value."""

    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    ratio_level: Literal["token", "sequence"] = "token"
    aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "k1"
    entropy_coef: float = 0.0
    value_clip: float = 0.2


class LossFn(Protocol):
    def __call__(self, batch: LossBatch, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, x, torch.zeros_like(x)).sum()


def aggregate(per_token: torch.Tensor, batch: LossBatch, aggregation: str) -> torch.Tensor:
    """This micro-batch's share of the step's token mean or sequence mean of `per_token` [N]."""
    if aggregation == "token_mean":
        return masked_sum(per_token, batch.loss_mask) / batch.token_denom
    if aggregation == "sequence_mean":
        keep = (batch.loss_mask > 0).to(per_token.dtype)
        seq_sum = per_token.new_zeros(batch.num_seqs).index_add(0, batch.seq_index, torch.where(keep > 0, per_token, 0.0))
        seq_len = keep.new_zeros(batch.num_seqs).index_add(0, batch.seq_index, keep)
        return (seq_sum / seq_len.clamp(min=1)).sum() / batch.seq_denom
    raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Schulman's estimators of KL(pi || ref) per token from samples of pi: [N].

    k1 = log(pi/ref); k2 = (log(pi/ref))^2 / 2; k3 = ref/pi - 1 - log(ref/pi) (unbiased, >= 0);
    low_var_kl = k3 clamped to [-10, 10] (guards the exp against a far-off token).
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        k3 = torch.expm1(-log_ratio) + log_ratio
        return k3.clamp(-10.0, 10.0) if kind == "low_var_kl" else k3
    raise ValueError(f"kl_loss_type must be one of {KL_TYPES}, got {kind!r}")


def ppo_clip(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss, clipped flag and approximate KL; all [N].

    ratio = exp(logp - old_logp); loss = max(-A * ratio, -A * clamp(ratio, 1 - low, 1 + high)).
    """
    log_ratio = logp - old_logp
    return _clip(torch.exp(log_ratio), advantages, eps_low, eps_high) + (-log_ratio.detach(),)


def _clip(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, batch: LossBatch) -> torch.Tensor:
    """GSPO-token ratio [N]: value s_i = exp(mean over sequence i's loss tokens of logp - old_logp)
    at every token of i, gradient s_i * grad(logp_t) (sg[s_i] * pi_t / sg[pi_t]); aggregated as a
    sequence mean this is exactly GSPO's sequence-level objective."""
    keep = (batch.loss_mask > 0).to(logp.dtype)
    log_ratio = torch.where(keep > 0, logp - old_logp, 0.0).detach()
    seq_sum = log_ratio.new_zeros(batch.num_seqs).index_add(0, batch.seq_index, log_ratio)
    seq_len = keep.new_zeros(batch.num_seqs).index_add(0, batch.seq_index, keep)
    seq_log_ratio = (seq_sum / seq_len.clamp(min=1)).index_select(0, batch.seq_index)
    return torch.exp(seq_log_ratio + logp - logp.detach())


def policy_loss(batch: LossBatch, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip (token ratio) or GSPO (sequence ratio), times the correction weights, + KL loss to
    the reference, - entropy bonus; aggregated per `settings.aggregation`."""
    if batch.advantages is None or batch.old_logp is None:
        raise ValueError("policy_loss needs advantages and old log-probs")
    m = batch.loss_mask
    if settings.ratio_level == "sequence":
        ratio = sequence_ratio(batch.logp, batch.old_logp, batch)
        pg, clipped = _clip(ratio, batch.advantages, settings.eps_clip, settings.eps_clip_high)
        approx_kl = (batch.old_logp - batch.logp).detach()
    else:
        pg, clipped, approx_kl = ppo_clip(batch.logp, batch.old_logp, batch.advantages, settings.eps_clip, settings.eps_clip_high)
    if batch.weights is not None:
        pg = pg * batch.weights
    per_token = pg - settings.entropy_coef * batch.entropy
    kl = torch.zeros_like(batch.logp)
    if batch.ref_logp is not None:
        kl = kl_estimate(batch.logp, batch.ref_logp, settings.kl_loss_type)
        if settings.kl_loss_coef:
            per_token = per_token + settings.kl_loss_coef * kl
    sums = {
        "pg_loss": masked_sum(pg, m).detach(),
        "pg_clipfrac": masked_sum(clipped, m),
        "ppo_kl": masked_sum(approx_kl, m),
        "kl": masked_sum(kl, m).detach(),
        "entropy": masked_sum(batch.entropy, m).detach(),
    }
    return aggregate(per_token, batch, settings.aggregation), sums


def sft_loss(batch: LossBatch, settings: LossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised: negative log-likelihood of the loss-mask tokens (e.g. assistant turns)."""
    nll = -batch.logp
    sums = {"sft_loss": masked_sum(nll, batch.loss_mask).detach(), "entropy": masked_sum(batch.entropy, batch.loss_mask).detach()}
    return aggregate(nll, batch, settings.aggregation), sums


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, batch: LossBatch, settings: LossSettings
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic: 0.5 * max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2), all [N]; metric sums
    value_loss, value_clipfrac."""
    clipped_v = old_values + (values - old_values).clamp(-settings.value_clip, settings.value_clip)
    unclipped, clipped = (values - returns).square(), (clipped_v - returns).square()
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    sums = {
        "value_loss": masked_sum(per_token, batch.loss_mask).detach(),
        "value_clipfrac": masked_sum((clipped > unclipped).float(), batch.loss_mask),
    }
    return aggregate(per_token, batch, settings.aggregation), sums


LOSSES: dict[str, LossFn] = {"policy_loss": policy_loss, "sft_loss": sft_loss}


def get_loss(loss_type: str, custom_path: str | None = None) -> LossFn:
    """"policy_loss" | "sft_loss", or "custom_loss" with `custom_path` (module:function) whose signature
    takes (batch, settings); refused at start naming --custom-loss-function-path otherwise."""
    if loss_type != "custom_loss":
        if loss_type not in LOSSES:
            raise ValueError(f"--loss-type must be one of {sorted(LOSSES) + ['custom_loss']}, got {loss_type!r}")
        return LOSSES[loss_type]
    if not custom_path:
        raise ValueError("--loss-type custom_loss needs --custom-loss-function-path module:function")
    fn = load_callable(custom_path, "--custom-loss-function-path")
    check_loss_signature(fn, custom_path)
    return fn


def check_loss_signature(fn: Callable, path: str) -> None:
    """A loss must take exactly two positional arguments (batch, settings)."""
    try:
        sig = inspect.signature(fn)
    except ValueError:
        return
    params = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_kw = [p.name for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    try:
        sig.bind(None, None)
        ok = not required_kw and (len(params) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()))
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(
            f"--custom-loss-function-path {path!r}: a loss takes (batch: LossBatch, settings: LossSettings) "
            f"and returns (loss, metric_sums); its signature is {sig}"
        )
