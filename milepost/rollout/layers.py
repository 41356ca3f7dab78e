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


# One trajectory -> its training sequence, or several (a branching session's selected leaves).
GenerateFn = Callable[[GenerateContext, PromptItem, int], Awaitable[Sample | list[Sample]]]


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


async def default_generate(ctx: GenerateContext, item: PromptItem, index: int,
                           ) -> Sample | list[Sample]:
    """One trajectory: through the agent fn and the session server when there is an agent fn,
    else one engine completion of the item's prompt ids."""
    if ctx.agent_fn is None:
        client = ctx.clients[ctx.group_index % len(ctx.clients)]
        return await generate_one(client, item, ctx.sampling, index, group_index=ctx.group_index,
                                  return_routed_experts=ctx.return_routed_experts)
    return await agent_generate(ctx, item, index)


async def agent_generate(ctx: GenerateContext, item: PromptItem, index: int,
                         ) -> Sample | list[Sample]:
    """Open a session, run the agent against it, take the sequences of the leaves the session
    server selects (`--session-leaf-selection`: one, or several for a branching session that
    forked), close the session. Every sequence carries the agent's reward."""
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
    out = []
    for d in samples:
        sample = Sample.from_dict(d)
        sample.group_index, sample.index, sample.label = ctx.group_index, index, item.label
        sample.metadata.update(outcome.metadata, prompt_index=item.index, trajectory=index,
                               leaves_selected=len(samples), agent_reward=outcome.reward)
        sample.reward = outcome.reward
        out.append(sample)
    return out[0] if len(out) == 1 else out


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

    async def one(g: int, item: PromptItem, k: int) -> list[Sample]:
        async with slots:
            got = await ctx.generate_fn(ctx.generate_context(g), item, k)
        return as_samples(got)

    async def group(g: int, item: PromptItem) -> tuple[list[Sample], str | None]:
        per_trajectory = await asyncio.gather(*(one(g, item, k)
                                                for k in range(ctx.n_samples_per_prompt)))
        samples = number_group(per_trajectory)
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


def as_samples(got: object) -> list[Sample]:
    """A generate fn's answer as a list, checked against the contract."""
    items = got if isinstance(got, list) else [got]
    bad = next((x for x in items if not isinstance(x, Sample)), None)
    if bad is not None or not items:
        what = type(bad).__name__ if bad is not None else "an empty list"
        raise LayerContractError(f"generate fn returned {what}, not Sample (or a non-empty "
                                 f"list of Samples)")
    return items


def number_group(per_trajectory: list[list[Sample]]) -> list[Sample]:
    """One group from its trajectories' sequences: `index` numbers the sequences of the group
    (unique within it); `metadata["trajectory"]` keeps which trajectory each came from."""
    samples = [s for seqs in per_trajectory for s in seqs]
    if len(samples) > len(per_trajectory):
        for i, s in enumerate(samples):
            s.metadata.setdefault("trajectory", s.index)
            s.index = i
    return samples


def load_layer(path: str | None, setting: str) -> Callable[..., Any] | None:
    return None if path is None else load_callable(path, setting)
