"""The three nested rollout plug-in layers (report 2.3, table 4), each chosen by import path.

- agent fn (innermost, `--agent-function-path`): `async (ctx: AgentContext) -> AgentOutcome`. Runs
  the agent-environment loop against `ctx.base_url`, an OpenAI-compatible endpoint of the session
  server, which records the tokens. May return a reward (e.g. the environment's own grade).
- generate fn (`--custom-generate-function-path`): `async (ctx: GenerateContext, item, index)
  -> Sample`. Records its own tokens (engine calls through `ctx.clients`).
- rollout fn (outermost, `--rollout-function-path`): `async (ctx: RolloutContext) ->
  RolloutResult`. Owns the data source, grouping, rewards incl. group rewards.

milepost keeps the model, engines, weight updates, advantages and the optimizer in every case.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from milepost.data.source import DataSource, PromptItem
from milepost.plugins import load_callable
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import RolloutResult, SamplingSettings, generate_one
from milepost.rollout.rewards import GroupRewardFn, RewardFn, score_group
from milepost.types import Sample, Status


@dataclass
class AgentContext:
    base_url: str  # {session server}/sessions/{id}/v1: give it to any OpenAI client
    item: PromptItem
    index: int  # which sample of its group
    http: httpx.AsyncClient
    max_new_tokens: int


@dataclass
class AgentOutcome:
    reward: float | None = None  # the environment's grade; None: the run's reward fn scores it
    metadata: dict[str, Any] = field(default_factory=dict)


AgentFn = Callable[[AgentContext], Awaitable[AgentOutcome]]


@dataclass
class GenerateContext:
    clients: list[EngineClient]
    sampling: SamplingSettings
    group_index: int
    session_url: str | None = None  # the session server, when the run started one
    agent_fn: AgentFn | None = None
    http: httpx.AsyncClient | None = None
    return_routed_experts: bool = False


GenerateFn = Callable[[GenerateContext, PromptItem, int], Awaitable[Sample]]


@dataclass
class RolloutContext:
    data: DataSource
    num_groups: int
    n_samples_per_prompt: int
    group_index_start: int
    generate_fn: GenerateFn
    generate_context: Callable[[int], GenerateContext]  # group index -> its context
    reward_fn: RewardFn | None
    group_reward_fn: GroupRewardFn | None
    max_concurrency: int = 64


RolloutFn = Callable[[RolloutContext], Awaitable[RolloutResult]]


class LayerContractError(RuntimeError):
    """A plug-in returned something outside its interface; the message names which one."""


async def default_generate(ctx: GenerateContext, item: PromptItem, index: int) -> Sample:
    """One trajectory: through the agent fn and the session server when there is an agent fn,
    else one engine completion of the item's prompt ids."""
    if ctx.agent_fn is None:
        client = ctx.clients[ctx.group_index % len(ctx.clients)]
        return await generate_one(client, item, ctx.sampling, index, group_index=ctx.group_index,
                                  return_routed_experts=ctx.return_routed_experts)
    return await agent_generate(ctx, item, index)


async def agent_generate(ctx: GenerateContext, item: PromptItem, index: int) -> Sample:
    """Open a session, run the agent against it, take the session's one training sequence (its
    latest leaf under branching), close the session."""
    if ctx.session_url is None or ctx.http is None:
        raise LayerContractError("an agent fn needs the session server (use_session_server)")
    http = ctx.http
    sid = (await _ok(await http.post(f"{ctx.session_url}/sessions")))["session_id"]
    try:
        agent_ctx = AgentContext(f"{ctx.session_url}/sessions/{sid}/v1", item, index, http,
                                 ctx.sampling.max_new_tokens)
        outcome = await ctx.agent_fn(agent_ctx)
        if not isinstance(outcome, AgentOutcome):
            raise LayerContractError(f"agent fn returned {type(outcome).__name__}, not "
                                     f"AgentOutcome")
        samples = (await _ok(await http.post(f"{ctx.session_url}/sessions/{sid}/samples"))
                   )["samples"]
    finally:
        await http.delete(f"{ctx.session_url}/sessions/{sid}")
    if not samples:  # the agent never asked the model anything: nothing to train on
        return Sample(group_index=ctx.group_index, index=index, tokens=list(item.prompt_ids),
                      response_length=0, prompt=item.prompt, label=item.label,
                      status=Status.ABORTED,
                      metadata={"abort_reason": "the agent made no model call", **outcome.metadata})
    sample = Sample.from_dict(samples[-1])
    sample.group_index, sample.index, sample.label = ctx.group_index, index, item.label
    sample.metadata.update(outcome.metadata, prompt_index=item.index,
                           agent_reward=outcome.reward)
    sample.reward = outcome.reward
    return sample


def agent_reward(sample: Sample) -> float:
    """A reward fn (`--reward-fn milepost.rollout.layers:agent_reward`) that keeps the agent fn's
    own grade, e.g. an environment's test script."""
    reward = sample.metadata.get("agent_reward")
    if reward is None:
        raise ValueError("agent_reward: the agent fn returned no reward for this sample")
    return float(reward)


async def _ok(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code >= 400:
        raise LayerContractError(f"session server answered {resp.status_code}: {resp.text[:300]}")
    return resp.json()


async def default_rollout(ctx: RolloutContext) -> RolloutResult:
    """Take `num_groups` prompts from the data source, generate each group with the generate fn,
    score it (the agent's own rewards stand when the run has no reward fn)."""
    items = ctx.data.next_batch(ctx.num_groups)
    slots = asyncio.Semaphore(ctx.max_concurrency)
    start = time.perf_counter()
    result = RolloutResult()

    async def one(g: int, item: PromptItem, k: int) -> Sample:
        async with slots:
            sample = await ctx.generate_fn(ctx.generate_context(g), item, k)
        if not isinstance(sample, Sample):
            raise LayerContractError(f"generate fn returned {type(sample).__name__}, not Sample")
        return sample

    async def group(g: int, item: PromptItem) -> tuple[list[Sample], str | None]:
        samples = list(await asyncio.gather(*(one(g, item, k)
                                              for k in range(ctx.n_samples_per_prompt))))
        if any(s.status is Status.ABORTED for s in samples):
            return samples, "aborted"
        if ctx.reward_fn is not None or ctx.group_reward_fn is not None:
            return samples, await score_group(samples, ctx.reward_fn, ctx.group_reward_fn)
        if any(s.reward is None for s in samples):
            return samples, "no reward fn and the generate/agent fn set no reward"
        return samples, None

    done = await asyncio.gather(*(group(ctx.group_index_start + i, it)
                                  for i, it in enumerate(items)))
    for item, (samples, error) in zip(items, done):  # in the order of the prompts
        if error == "aborted":
            result.aborted_groups.append(samples)
            result.requeue.append(item)
        elif error is not None:
            result.failed_groups.append(samples)
            result.dropped.append(item)
            result.num_reward_errors += 1
        else:
            result.groups.append(samples)
    result.elapsed_s = time.perf_counter() - start
    return result


def load_layer(path: str | None, setting: str) -> Callable[..., Any] | None:
    return None if path is None else load_callable(path, setting)
