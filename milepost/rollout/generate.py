"""The default generate fn (one prompt -> one trajectory) and rollout fn (prompts -> scored groups).

Tokens are taken exactly as the engine produced them: a sample's tokens are the prompt ids plus
the engine's output ids, never re-tokenized text. A group is trained on only when every sample in
it finished and was scored; otherwise it is set aside with the reason, and its prompt is either
handed back to the data source (generation gave up: the engine aborted, vanished or timed out,
so trying again later can succeed) or dropped and counted (the engine refused the request or
the reward function failed: trying again would fail the same way). Report section 2.2.2.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from milepost.data.source import PromptItem
from milepost.rollout.client import (
    EngineClient,
    EngineProtocolError,
    EngineRequestError,
    EngineUnavailableError,
)
from milepost.rollout.rewards import GroupRewardFn, RewardFn, score_group
from milepost.types import Group, Sample, Status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSettings:
    """Sampling of rollout requests (SGLang's parameter names and meanings).

    temperature: 0 is greedy. top_k: -1 keeps all tokens. max_new_tokens: the response length
    limit (a response that reaches it is TRUNCATED). stop / stop_token_ids: extra stop strings and
    ids (the model's EOS always stops).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 1024
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # --deterministic: each request samples with its own seed (request_seed), so its tokens do not
    # depend on which other requests the engine batched it with.
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def to_params(self) -> dict[str, Any]:
        """SGLang's `sampling_params` object."""
        params: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                                  "top_k": self.top_k, "max_new_tokens": self.max_new_tokens}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


def request_seed(seed: int, group_index: int, index: int) -> int:
    """The sampling seed of sample `index` of group `group_index` under --deterministic."""
    return (seed * 1_000_003 + group_index * 4099 + index) % (2**63 - 1)


_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


async def generate_one(client: EngineClient, item: PromptItem, sampling: SamplingSettings,
                       index: int, *, group_index: int | None = None, rid: str | None = None,
                       routing_key: str | None = None, return_routed_experts: bool = False,
                       top_logprobs_num: int = 0) -> Sample:
    """One trajectory for `item`: sample `index` of group `group_index` (default: item.index).

    Status: COMPLETED when the model stopped, TRUNCATED at max_new_tokens, ABORTED when the
    engine aborted the request (partial tokens kept; `metadata["abort_reason"]`), could not be
    reached (`abort_reason`) or refused it (`metadata["engine_error"]`, the engine's message).
    `metadata` holds the row's metadata plus prompt_index, engine, finish_reason,
    prompt_tokens, cached_tokens and latency_s (these names win over the row's).
    top_logprobs_num > 0 (top-K distillation): `metadata["student_top_logprobs"]` holds, per
    response token, the engine's top [logprob, id] pairs.
    """
    sample = Sample(
        group_index=item.index if group_index is None else group_index, index=index,
        tokens=list(item.prompt_ids), response_length=0, prompt=item.prompt, label=item.label,
        metadata={**item.metadata, "prompt_index": item.index, "engine": client.base_url},
    )
    start = time.perf_counter()
    try:
        # A row's metadata may carry `sampling_params` for its own requests (e.g. a longer
        # max_new_tokens for a harder prompt); they override the run's settings.
        params = {**sampling.to_params(), **(item.metadata.get("sampling_params") or {})}
        if sampling.seed is not None:
            params["sampling_seed"] = request_seed(sampling.seed, sample.group_index, index)
        out = await client.generate(item.prompt_ids, params, return_logprob=True,
                                    return_routed_experts=return_routed_experts, rid=rid,
                                    routing_key=routing_key, top_logprobs_num=top_logprobs_num,
                                    lora_path=item.metadata.get("lora_adapter"))  # multi-LoRA
    except EngineUnavailableError as e:
        sample.status = Status.ABORTED
        sample.metadata["abort_reason"] = str(e)
        return sample
    except EngineRequestError as e:
        sample.status = Status.ABORTED
        sample.metadata["engine_error"] = str(e)
        return sample
    status = _STATUS.get(out.finish_type)
    if status is None:
        raise EngineProtocolError(f"{client.base_url}/generate",
                                  f"unknown finish_reason {out.finish_reason!r}")
    n = len(out.output_ids)
    sample.tokens = list(item.prompt_ids) + out.output_ids
    sample.response_length = n
    sample.response = out.text
    sample.loss_mask = [1] * n
    sample.rollout_logprobs = out.logprobs
    sample.weight_versions = out.weight_versions
    sample.routed_experts = out.routed_experts
    sample.status = status
    sample.metadata.update(finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                           cached_tokens=out.cached_tokens,
                           latency_s=time.perf_counter() - start)
    for key in ("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts"):
        if key in out.meta_info:  # a speculating engine (SGLang's names)
            sample.metadata[key] = int(out.meta_info[key])
    if top_logprobs_num:
        sample.metadata["student_top_logprobs"] = [
            [[float(e[0]), int(e[1])] for e in row] for row in out.meta_info.get("output_top_logprobs") or []]
    if status is Status.ABORTED:
        sample.metadata["abort_reason"] = str(out.finish_reason.get("message", "aborted"))
    return sample


class RolloutError(RuntimeError):
    """Every group of a rollout failed for good (a broken reward function, or requests every
    engine refuses): going on would only drop every prompt. Not raised for reward errors when
    they are retried (retry_reward_errors=True)."""


@dataclass
class RolloutResult:
    """What a rollout produced, in the order of its prompts.

    groups: trainable groups: every sample COMPLETED or TRUNCATED, and rewarded.
    requeue: prompts of `aborted_groups` (generation gave up): give them back to the data source.
    dropped: prompts of `failed_groups` (the engine refused a request, or rewarding failed: see
        each sample's metadata "engine_error" / "reward_error"); with retry_reward_errors=True,
        prompts of reward failures go to `requeue` instead.
    """

    groups: list[Group] = field(default_factory=list)
    requeue: list[PromptItem] = field(default_factory=list)
    dropped: list[PromptItem] = field(default_factory=list)
    aborted_groups: list[Group] = field(default_factory=list)
    failed_groups: list[Group] = field(default_factory=list)
    num_reward_errors: int = 0  # groups whose reward function failed
    num_engine_refusals: int = 0  # groups with a request the engine refused (4xx)
    num_teacher_failures: int = 0  # groups a distillation teacher could not score (requeued)
    elapsed_s: float = 0.0

    @property
    def num_aborted_groups(self) -> int:
        return len(self.aborted_groups)

    @property
    def num_truncated(self) -> int:
        """TRUNCATED samples among the trainable groups."""
        return sum(s.status is Status.TRUNCATED for g in self.groups for s in g)


T = TypeVar("T")


async def _gather_or_cancel(aws: Sequence[Awaitable[T]]) -> list[T]:
    """asyncio.gather that, when one task raises, cancels the rest before re-raising."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def rollout_groups(
    clients: Sequence[EngineClient],
    items: Sequence[PromptItem],
    n_samples_per_prompt: int,
    sampling: SamplingSettings,
    reward_fn: RewardFn | None,
    group_reward_fn: GroupRewardFn | None = None,
    max_concurrency: int = 256,
    *,
    retry_reward_errors: bool = False,
    return_routed_experts: bool = False,
    group_index_start: int = 0,
    finish_group: Callable[[Group], Awaitable[str | None]] | None = None,
    top_logprobs_num: int = 0,
) -> RolloutResult:
    """Generate `n_samples_per_prompt` trajectories for every item, concurrently, and score each
    group as soon as it is complete.

    Group g (sample.group_index = group_index_start + g) goes to clients[(start + g) % len],
    all of its samples to the same engine so they share its prefix cache. At most
    `max_concurrency` requests are in flight. Rewards: see `score_group`. `finish_group` (a
    distillation teacher) runs on each scored group while others generate; a message back means
    the group is not trained on: its prompt is requeued and counted (num_teacher_failures).
    Raises RolloutError when every group failed for a deterministic reason (see the class).
    """
    if not clients:
        raise ValueError("rollout_groups: no engine clients given")
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if reward_fn is None and group_reward_fn is None:
        raise ValueError("rollout_groups: give a reward_fn, a group_reward_fn, or both")
    slots = asyncio.Semaphore(max_concurrency)
    start = time.perf_counter()

    async def sample(client: EngineClient, item: PromptItem, g: int, k: int) -> Sample:
        async with slots:
            return await generate_one(client, item, sampling, k, group_index=g,
                                      return_routed_experts=return_routed_experts,
                                      top_logprobs_num=top_logprobs_num)

    async def group(g: int, item: PromptItem) -> tuple[Group, str | None, str | None]:
        client = clients[g % len(clients)]
        samples = await _gather_or_cancel(
            [sample(client, item, g, k) for k in range(n_samples_per_prompt)])
        if any(s.status is Status.ABORTED for s in samples):
            return samples, None, None
        reward_error = await score_group(samples, reward_fn, group_reward_fn)
        if reward_error is not None or finish_group is None:
            return samples, reward_error, None
        return samples, None, await finish_group(samples)

    outcomes = await _gather_or_cancel(
        [group(group_index_start + g, it) for g, it in enumerate(items)])
    result = RolloutResult(elapsed_s=time.perf_counter() - start)
    first_error = None
    for item, (samples, reward_error, teacher_error) in zip(items, outcomes):
        refused = next((s.metadata["engine_error"] for s in samples
                        if "engine_error" in s.metadata), None)
        if refused is not None:
            result.failed_groups.append(samples)
            result.dropped.append(item)
            result.num_engine_refusals += 1
            first_error = first_error or refused
        elif any(s.status is Status.ABORTED for s in samples):
            result.aborted_groups.append(samples)
            result.requeue.append(item)
        elif reward_error is not None:
            result.failed_groups.append(samples)
            (result.requeue if retry_reward_errors else result.dropped).append(item)
            result.num_reward_errors += 1
            first_error = first_error or reward_error
        elif teacher_error is not None:
            result.requeue.append(item)
            result.num_teacher_failures += 1
        else:
            result.groups.append(samples)
    _report(result, first_error, retry_reward_errors)
    return result


def _report(result: RolloutResult, first_error: str | None, retry_reward_errors: bool) -> None:
    n = len(result.groups) + len(result.aborted_groups) + len(result.failed_groups)
    if result.aborted_groups:
        reason = next(s.metadata.get("abort_reason") for s in (result.aborted_groups[0])
                      if s.status is Status.ABORTED)
        log.warning("rollout: %d of %d groups aborted (prompts requeued); first reason: %s",
                    len(result.aborted_groups), n, reason)
    if result.failed_groups:
        log.error("rollout: %d of %d groups failed and are not trained on (%d reward function "
                  "errors, %d engine refusals); first error: %s", len(result.failed_groups), n,
                  result.num_reward_errors, result.num_engine_refusals, first_error)
        final = result.num_engine_refusals + (0 if retry_reward_errors
                                               else result.num_reward_errors)
        if final == n:
            raise RolloutError(f"every group of the rollout failed ({result.num_reward_errors} "
                               f"reward function errors, {result.num_engine_refusals} engine "
                               f"refusals); first error: {first_error}")


def rollout_metrics(result: RolloutResult) -> dict[str, float]:
    """Per-rollout numbers for the metrics sinks (no prefix; the driver adds `rollout/`).

    reward_* / response_len_* / truncated_frac: over the trainable groups (absent when none).
    prefix_cache_hit_rate: cached / prompt tokens over every answered request.
    spec_accept_length / spec_accept_rate: with speculating engines, 1 + accepted proposals per
    verify step, and accepted / proposed, over every answered request.
    tokens_per_s: response tokens of every answered request / the rollout's wall time.
    session_*: divergences of the session server's sessions (rollbacks, forks, rejections, and
    sampled tokens re-tokenized as context) and tool-call blocks of the model that did not parse,
    when the samples came from it.
    """
    trained = [s for g in result.groups for s in g]
    answered = [s for g in (*result.groups, *result.aborted_groups, *result.failed_groups)
                for s in g if "prompt_tokens" in s.metadata]
    out: dict[str, float] = {
        "num_groups": float(len(result.groups)),
        "num_samples": float(len(trained)),
        "aborted_groups": float(result.num_aborted_groups),
        "failed_groups": float(len(result.failed_groups)),
        "reward_errors": float(result.num_reward_errors),
        "engine_refusals": float(result.num_engine_refusals),
        "teacher_failed_groups": float(result.num_teacher_failures),
        "elapsed_s": result.elapsed_s,
    }
    if trained:
        rewards = [float(s.reward) for s in trained if s.reward is not None]
        mean = sum(rewards) / len(rewards)
        lengths = [s.response_length for s in trained]
        out.update(
            reward_mean=mean,
            reward_std=math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
            response_len_mean=sum(lengths) / len(lengths),
            response_len_max=float(max(lengths)),
            truncated_frac=result.num_truncated / len(trained),
        )
    prompt_tokens = sum(s.metadata["prompt_tokens"] for s in answered)
    if prompt_tokens:
        cached = sum(s.metadata["cached_tokens"] for s in answered)
        out["prefix_cache_hit_rate"] = cached / prompt_tokens
    verifies = sum(s.metadata.get("spec_verify_ct", 0) for s in answered)
    if verifies:  # speculating engines: tokens per verify step, and the share of proposals kept
        correct = sum(s.metadata.get("spec_num_correct_drafts", 0) for s in answered)
        proposed = sum(s.metadata.get("spec_num_proposed_drafts", 0) for s in answered)
        out["spec_accept_length"] = 1.0 + correct / verifies
        out["spec_accept_rate"] = correct / max(proposed, 1)
    if result.elapsed_s > 0:
        out["tokens_per_s"] = sum(s.response_length for s in answered) / result.elapsed_s
    # Session server divergences (session/divergence.py): counted once per session.
    sessions = {s.metadata["session_id"]: s.metadata for s in answered
                if "session_rollbacks" in s.metadata}
    for key in ("session_rollbacks", "session_forks", "session_rejections",
                "session_retokenized_tokens"):
        if sessions:
            out[key] = float(sum(m[key] for m in sessions.values()))
    if sessions:  # per sequence: the model's tool-call blocks that did not parse (kept as text)
        out["session_unparsed_tool_calls"] = float(sum(
            s.metadata.get("session_unparsed_tool_calls", 0) for s in answered))
    return out
