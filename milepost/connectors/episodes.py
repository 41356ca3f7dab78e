"""Episodes of outside environments, run as agent fns: a bad environment fails its episode, not the run.

An environment that raises, hangs past its time limit or returns a reward that is not a finite
number ends its episode with `metadata["env_error"]` naming what happened; `env_reward` then
raises, so the group is reported as a reward error (`rollout/reward_errors`, each sample's
`metadata["reward_error"]`) and kept out of training, and the run goes on (docs/environments.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable
from typing import Any

from milepost.data.source import PromptItem
from milepost.rollout.layers import AgentOutcome, GenerateContext, agent_generate
from milepost.types import Sample, Status

log = logging.getLogger(__name__)

ERROR_KEY = "env_error"
DEFAULT_TIMEOUT_S = 300.0


async def run_episode(episode: Awaitable[tuple[Any, dict[str, Any]]], *, timeout_s: float,
                      what: str) -> AgentOutcome:
    """Await `episode` (-> (reward, metadata)) for at most `timeout_s`; any failure, a timeout or
    a reward that is not a finite number becomes an outcome carrying `metadata["env_error"]`."""
    try:
        reward, metadata = await asyncio.wait_for(episode, timeout=timeout_s)
    except asyncio.TimeoutError:
        return failed(f"{what}: no result within {timeout_s:g} s (the episode's time limit)")
    except Exception as e:  # noqa: BLE001 - an environment may raise anything; it is reported
        return failed(f"{what}: {type(e).__name__}: {e}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        return failed(f"{what}: malformed reward {reward!r} (expected a finite number)", metadata)
    return AgentOutcome(reward=float(reward), metadata=metadata)


def failed(reason: str, metadata: dict[str, Any] | None = None) -> AgentOutcome:
    """An outcome that fails its episode with `reason` (logged once)."""
    log.warning("environment episode failed (its group is not trained on): %s", reason)
    return AgentOutcome(metadata={**(metadata or {}), ERROR_KEY: reason})


def env_reward(sample: Sample) -> float:
    """The environment's own grade; raises with the episode's error when it failed."""
    error = sample.metadata.get(ERROR_KEY)
    if error is not None:
        raise RuntimeError(error)
    reward = sample.metadata.get("agent_reward")
    if reward is None:
        raise ValueError("the environment episode returned no reward for this sample")
    return float(reward)


async def env_generate(ctx: GenerateContext, item: PromptItem, index: int,
                       ) -> Sample | list[Sample]:
    """The agent layer (`agent_generate`), except that an episode whose environment failed before
    the model was called counts as failed (its group is reported and dropped), not as aborted
    (which would put the prompt back for ever)."""
    got = await agent_generate(ctx, item, index)
    for s in got if isinstance(got, list) else [got]:
        if s.status is Status.ABORTED and ERROR_KEY in s.metadata:
            s.status = Status.COMPLETED  # nothing generated; env_reward refuses it with the reason
    return got


def timeout_of(meta: dict[str, Any]) -> float:
    return float(meta.get("timeout_s", DEFAULT_TIMEOUT_S))
