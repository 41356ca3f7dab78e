"""The sampling settings of a run's rollouts and evaluations, read from its config.

Evaluation takes --eval-temperature / --eval-top-p / --eval-max-response-len where given and the
rollout's values otherwise. The seed is the caller's: the sync runtime seeds requests under
--deterministic (evaluations with another seed than the rollouts), the fully-async worker does not.
"""

from __future__ import annotations

from typing import TypeVar

from milepost.config import TrainConfig
from milepost.rollout.generate import SamplingSettings

V = TypeVar("V")


def rollout_sampling(cfg: TrainConfig, seed: int | None) -> SamplingSettings:
    """How rollouts sample; `seed` makes each request's draws reproducible (request_seed)."""
    return SamplingSettings(
        temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p, top_k=cfg.rollout_top_k,
        max_new_tokens=cfg.rollout_max_response_len, stop=tuple(cfg.rollout_stop or ()),
        stop_token_ids=tuple(cfg.rollout_stop_token_ids or ()), seed=seed)


def eval_sampling(cfg: TrainConfig, seed: int | None) -> SamplingSettings:
    """How evaluations sample: the --eval-* settings, each defaulting to its rollout setting."""
    return SamplingSettings(
        temperature=_default(cfg.eval_temperature, cfg.rollout_temperature),
        top_p=_default(cfg.eval_top_p, cfg.rollout_top_p), top_k=cfg.rollout_top_k,
        max_new_tokens=_default(cfg.eval_max_response_len, cfg.rollout_max_response_len),
        stop=tuple(cfg.rollout_stop or ()),
        stop_token_ids=tuple(cfg.rollout_stop_token_ids or ()), seed=seed)


def _default(value: V | None, fallback: V) -> V:
    return fallback if value is None else value
