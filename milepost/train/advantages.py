"""Advantage estimators: samples (with rewards) -> one advantage per response token (report 3.4).

An estimator is `fn(samples, settings, inputs) -> list[Tensor [response_length]] | Advantages`,
found by a registered name or an import path ("my_pkg.adv:my_estimator"). Shipped: grpo, gspo
(GRPO's group-relative advantages; GSPO differs in the loss: a sequence-level ratio),
reinforce_plus_plus, reinforce_plus_plus_baseline and ppo (GAE over a learned value function).
Token-level estimators (REINFORCE++, PPO) whiten advantages over all loss tokens of the rollout.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from milepost.plugins import load_callable
from milepost.types import Sample


@dataclass(frozen=True)
class AdvantageSettings:
    """normalize_std: GRPO/GSPO divide by the group's reward std; REINFORCE++/PPO whiten over the
        rollout's loss tokens (mean 0, std 1). Off = centered only (GRPO) / raw (token estimators).
    eps: added to every std so uniform groups give advantage 0, not a division by zero.
    gamma / lambd: discount and GAE lambda (ppo; gamma also discounts REINFORCE++ returns).
    kl_coef: KL-to-reference penalty folded into the per-token rewards (token estimators only)."""

    normalize_std: bool = True
    eps: float = 1e-6
    gamma: float = 1.0
    lambd: float = 1.0
    kl_coef: float = 0.0


@dataclass
class AdvantageInputs:
    """What the trainer computed before estimating, per sample (each [response_length] fp32).

    loss_masks: 1 where the policy is trained on the token; None = all ones.
    values: the critic's V(s_t) before response token t (ppo).
    kl: per-token KL estimate policy vs reference, for the reward penalty (kl_coef > 0).
    """

    loss_masks: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    kl: list[torch.Tensor] | None = None


@dataclass
class Advantages:
    """advantages: per sample [response_length] fp32. returns: value targets (ppo), else None."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor] | None = None


AdvantageEstimator = Callable[[Sequence[Sample], AdvantageSettings, AdvantageInputs], "list[torch.Tensor] | Advantages"]

_REGISTRY: dict[str, AdvantageEstimator] = {}
TOKEN_LEVEL = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")


def register(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: make `fn` available to `get_estimator(name)`."""

    def wrap(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return wrap


def registered_estimators() -> list[str]:
    return sorted(_REGISTRY)


def get_estimator(name: str) -> AdvantageEstimator:
    """A registered estimator by name, or any callable by import path `module.sub:function` whose
    signature takes (samples, settings, inputs); refused naming --advantage-estimator otherwise."""
    if ":" in name:
        fn = load_callable(name, "--advantage-estimator")
        try:
            inspect.signature(fn).bind(None, None, None)
        except TypeError as e:
            raise ValueError(
                f"--advantage-estimator {name!r}: the estimator must take (samples, settings, inputs) "
                f"and return one [response_length] tensor per sample; its signature does not fit ({e})"
            ) from None
        except ValueError:
            pass  # builtins without an inspectable signature: trust them
        return fn
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown advantage estimator {name!r} (--advantage-estimator); registered: "
            f"{registered_estimators()} (or use 'module:function')"
        )
    return _REGISTRY[name]


def estimate(
    name: str, samples: Sequence[Sample], settings: AdvantageSettings, inputs: AdvantageInputs | None = None
) -> Advantages:
    """Run estimator `name` and check its output shapes (a plug-in's mistake is named, not trained on)."""
    out = get_estimator(name)(samples, settings, inputs or AdvantageInputs())
    result = out if isinstance(out, Advantages) else Advantages(list(out))
    if len(result.advantages) != len(samples):
        raise ValueError(f"advantage estimator {name!r} returned {len(result.advantages)} tensors for {len(samples)} samples")
    for s, a in zip(samples, result.advantages):
        if tuple(a.shape) != (s.response_length,):
            raise ValueError(
                f"advantage estimator {name!r} returned shape {tuple(a.shape)} for a sample of "
                f"response_length {s.response_length}"
            )
    result.advantages = [a.detach().float().cpu() for a in result.advantages]
    return result


def rewards_of(samples: Sequence[Sample]) -> list[float]:
    """Each sample's scalar reward; refuses samples that were never scored."""
    missing = [(s.group_index, s.index) for s in samples if s.reward is None]
    if missing:
        raise ValueError(f"samples (group_index, index) {missing[:5]} have no reward; score them before training")
    return [float(s.reward) for s in samples]


def _groups(samples: Sequence[Sample]) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_index, []).append(i)
    return list(groups.values())


def group_normalized_rewards(samples: Sequence[Sample], settings: AdvantageSettings) -> list[float]:
    """reward - mean of its group (same group_index), divided by (std + eps) if normalize_std.

    std is the Bessel-corrected sample std, as GRPO implementations use; a group of one sample has
    std 0 (and advantage 0). Computed in float64.
    """
    rewards = rewards_of(samples)
    out = [0.0] * len(samples)
    for members in _groups(samples):
        r = torch.tensor([rewards[i] for i in members], dtype=torch.float64)
        centered = r - r.mean()
        if settings.normalize_std:
            std = r.std() if len(members) > 1 else torch.zeros((), dtype=torch.float64)
            centered = centered / (std + settings.eps)
        for i, a in zip(members, centered.tolist()):
            out[i] = a
    return out


@register("grpo")
def grpo(samples: Sequence[Sample], settings: AdvantageSettings, inputs: AdvantageInputs | None = None) -> list[torch.Tensor]:
    """GRPO: the group-normalized reward, the same for every response token of a sample."""
    advantages = group_normalized_rewards(samples, settings)
    return [torch.full((s.response_length,), a, dtype=torch.float32) for s, a in zip(samples, advantages)]


@register("gspo")
def gspo(samples: Sequence[Sample], settings: AdvantageSettings, inputs: AdvantageInputs | None = None) -> list[torch.Tensor]:
    """GSPO: GRPO's group-normalized advantages; the sequence-level ratio lives in the policy loss."""
    return grpo(samples, settings, inputs)


# --- token-level estimators ----------------------------------------------------------------------


def _masks(samples: Sequence[Sample], inputs: AdvantageInputs) -> list[torch.Tensor]:
    if inputs.loss_masks is not None:
        return [m.double() for m in inputs.loss_masks]
    return [torch.ones(s.response_length, dtype=torch.float64) for s in samples]


def token_rewards(
    samples: Sequence[Sample], final: Sequence[float], settings: AdvantageSettings, inputs: AdvantageInputs
) -> list[torch.Tensor]:
    """Per-token rewards [response_length] float64: -kl_coef * kl_t on loss tokens, plus `final` on
    the last token (the outcome reward arrives when the trajectory ends)."""
    masks = _masks(samples, inputs)
    out = []
    for i, (s, m) in enumerate(zip(samples, masks)):
        r = torch.zeros(s.response_length, dtype=torch.float64)
        if settings.kl_coef:
            if inputs.kl is None:
                raise ValueError("kl_coef > 0 needs per-token KL estimates (AdvantageInputs.kl)")
            r -= settings.kl_coef * inputs.kl[i].double() * m
        r[-1] += final[i]
        out.append(r)
    return out


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s over one response: [T] -> [T]."""
    out = torch.empty_like(rewards)
    running = rewards.new_zeros(())
    for t in range(rewards.numel() - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float) -> torch.Tensor:
    """Generalized advantage estimation over one response: A_t = sum_l (gamma lambd)^l delta_{t+l},
    delta_t = r_t + gamma V_{t+1} - V_t with V after the last token = 0 (the episode ends)."""
    adv = torch.empty_like(rewards)
    running = rewards.new_zeros(())
    for t in range(rewards.numel() - 1, -1, -1):
        next_v = values[t + 1] if t + 1 < values.numel() else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        running = delta + gamma * lambd * running
        adv[t] = running
    return adv


def whiten(values: list[torch.Tensor], masks: list[torch.Tensor], eps: float) -> list[torch.Tensor]:
    """(x - mean) / (std + eps) with mean and population std over the loss tokens of all samples."""
    flat = torch.cat([v.double() for v in values])
    keep = torch.cat(masks) > 0
    if not bool(keep.any()):
        return [torch.zeros_like(v) for v in values]
    picked = flat[keep]
    mean, std = picked.mean(), picked.std(unbiased=False)
    return [(v.double() - mean) / (std + eps) for v in values]


def _finish(samples, values, settings, inputs) -> list[torch.Tensor]:
    if settings.normalize_std:
        values = whiten(values, _masks(samples, inputs), settings.eps)
    return [v.float() for v in values]


@register("reinforce_plus_plus")
def reinforce_plus_plus(samples: Sequence[Sample], settings: AdvantageSettings, inputs: AdvantageInputs) -> list[torch.Tensor]:
    """REINFORCE++: discounted return of the per-token rewards (outcome + KL penalty), whitened."""
    rewards = token_rewards(samples, rewards_of(samples), settings, inputs)
    return _finish(samples, [discounted_returns(r, settings.gamma) for r in rewards], settings, inputs)


@register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(
    samples: Sequence[Sample], settings: AdvantageSettings, inputs: AdvantageInputs
) -> list[torch.Tensor]:
    """REINFORCE++ with a baseline: the outcome minus its group's mean reward (a group of one gets
    0), plus the KL penalty, discounted, then whitened over the rollout."""
    rewards = rewards_of(samples)
    final = [0.0] * len(samples)
    for members in _groups(samples):
        mean = sum(rewards[i] for i in members) / len(members)
        for i in members:
            final[i] = rewards[i] - mean
    per_token = token_rewards(samples, final, settings, inputs)
    return _finish(samples, [discounted_returns(r, settings.gamma) for r in per_token], settings, inputs)


@register("ppo")
def ppo(samples: Sequence[Sample], settings: AdvantageSettings, inputs: AdvantageInputs) -> Advantages:
    """PPO: GAE(gamma, lambd) over the critic's values; returns = GAE + V are the value targets
    (taken before whitening the advantages)."""
    if inputs.values is None:
        raise ValueError("advantage estimator 'ppo' needs the critic's values (set --critic-lr to train one)")
    rewards = token_rewards(samples, rewards_of(samples), settings, inputs)
    raw = [gae(r, v.double(), settings.gamma, settings.lambd) for r, v in zip(rewards, inputs.values)]
    returns = [(a + v.double()).float() for a, v in zip(raw, inputs.values)]
    return Advantages(_finish(samples, raw, settings, inputs), returns)
