"""Advantage estimators: samples (with rewards) -> one advantage per response token.

An estimator is `fn(samples, settings) -> list[Tensor [response_length] fp32]`, found by a
registered name ("grpo") or an import path ("my_pkg.adv:my_estimator"). GRPO is here; GSPO,
REINFORCE++ and PPO (report section 3.4) register themselves here when they land.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from milepost.plugins import load_callable
from milepost.types import Sample


@dataclass(frozen=True)
class AdvantageSettings:
    """normalize_std: GRPO divides by the group's reward std (Dr. GRPO-style runs turn it off).
    eps: added to the std so uniform groups give advantage 0, not a division by zero."""

    normalize_std: bool = True
    eps: float = 1e-6


AdvantageEstimator = Callable[[Sequence[Sample], AdvantageSettings], list[torch.Tensor]]

_REGISTRY: dict[str, AdvantageEstimator] = {}


def register(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: make `fn` available to `get_estimator(name)`."""

    def wrap(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return wrap


def get_estimator(name: str) -> AdvantageEstimator:
    """A registered estimator by name, or any callable by import path `module.sub:function`."""
    if ":" in name:
        return load_callable(name, "advantage_estimator")
    if name not in _REGISTRY:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(_REGISTRY)} (or use 'module:function')")
    return _REGISTRY[name]


def rewards_of(samples: Sequence[Sample]) -> list[float]:
    """Each sample's scalar reward; refuses samples that were never scored."""
    missing = [(s.group_index, s.index) for s in samples if s.reward is None]
    if missing:
        raise ValueError(f"samples (group_index, index) {missing[:5]} have no reward; score them before training")
    return [float(s.reward) for s in samples]


def group_normalized_rewards(samples: Sequence[Sample], settings: AdvantageSettings) -> list[float]:
    """reward - mean of its group (same group_index), divided by (std + eps) if normalize_std.

    std is the Bessel-corrected sample std, as GRPO implementations use; a group of one sample has
    std 0 (and advantage 0). Computed in float64.
    """
    rewards = rewards_of(samples)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group_index, []).append(i)
    out = [0.0] * len(samples)
    for members in groups.values():
        r = torch.tensor([rewards[i] for i in members], dtype=torch.float64)
        centered = r - r.mean()
        if settings.normalize_std:
            std = r.std() if len(members) > 1 else torch.zeros((), dtype=torch.float64)
            centered = centered / (std + settings.eps)
        for i, a in zip(members, centered.tolist()):
            out[i] = a
    return out


@register("grpo")
def grpo(samples: Sequence[Sample], settings: AdvantageSettings) -> list[torch.Tensor]:
    """GRPO: the group-normalized reward, the same for every response token of a sample."""
    advantages = group_normalized_rewards(samples, settings)
    return [torch.full((s.response_length,), a, dtype=torch.float32) for s, a in zip(samples, advantages)]
