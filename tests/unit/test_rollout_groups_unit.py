"""rollout_groups over a fake engine: group outcomes (trained, requeued, dropped), reward errors,
round-robin placement, concurrency limit, metrics."""

from __future__ import annotations

import asyncio

import pytest

from milepost.data.source import PromptItem
from milepost.rollout.client import (
    EngineProtocolError,
    EngineRequestError,
    EngineUnavailableError,
    GenerateOutput,
)
from milepost.rollout.generate import (
    RolloutError,
    SamplingSettings,
    generate_one,
    rollout_groups,
    rollout_metrics,
)
from milepost.rollout.rewards import math_reward
from milepost.types import Status


class FakeEngine:
    """Answers "the answer is <prompt_ids[0]>" unless told to fail for a prompt."""

    def __init__(self, name: str, fail: dict[int, str] | None = None) -> None:
        self.base_url = f"http://{name}"
        self.fail = fail or {}
        self.prompts: list[int] = []
        self.in_flight = self.max_in_flight = 0

    async def generate(self, input_ids, sampling_params, **kw) -> GenerateOutput:
        self.prompts.append(input_ids[0])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.001)
        self.in_flight -= 1
        how = self.fail.get(input_ids[0])
        if how == "down":
            raise EngineUnavailableError(f"{self.base_url}/generate", "ConnectError")
        if how == "refuse":
            raise EngineRequestError(f"{self.base_url}/generate", "prompt too long", 400)
        if how == "garbage":
            finish = {"type": "exploded"}
        else:
            finish = {"type": {"abort": "abort", "length": "length"}.get(how, "stop")}
        n = sampling_params["max_new_tokens"]
        return GenerateOutput(
            output_ids=list(range(100, 100 + n)), text=f"the answer is {input_ids[0]}",
            logprobs=[-0.5] * n, weight_versions=["3"] * n, finish_reason=finish,
            weight_version="3", prompt_tokens=len(input_ids), cached_tokens=1)


def items(n: int) -> list[PromptItem]:
    return [PromptItem(index=i, prompt=f"p{i}", prompt_ids=[i, 7, 7], label=str(i),
                       metadata={"src": "t"}) for i in range(n)]


SAMPLING = SamplingSettings(temperature=0.7, max_new_tokens=4)


def test_sampling_settings():
    assert SAMPLING.to_params() == {"temperature": 0.7, "top_p": 1.0, "top_k": -1,
                                    "max_new_tokens": 4}
    s = SamplingSettings(stop=["\n"], stop_token_ids=[2])
    assert s.to_params()["stop"] == ["\n"] and s.to_params()["stop_token_ids"] == [2]
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": 0}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError):
            SamplingSettings(**bad)


def test_generate_one_fields():
    s = asyncio.run(generate_one(FakeEngine("e"), items(3)[2], SAMPLING, 1))
    assert s.tokens == [2, 7, 7, 100, 101, 102, 103] and s.response_length == 4
    assert s.response_ids == [100, 101, 102, 103] and s.prompt_length == 3
    assert s.loss_mask == [1] * 4 and s.rollout_logprobs == [-0.5] * 4
    assert s.weight_versions == ["3"] * 4 and s.status is Status.COMPLETED
    assert (s.group_index, s.index, s.label, s.prompt) == (2, 1, "2", "p2")
    assert s.metadata["src"] == "t" and s.metadata["prompt_index"] == 2
    assert s.metadata["cached_tokens"] == 1 and s.metadata["engine"] == "http://e"


def test_outcomes_trained_requeued_dropped():
    engine = FakeEngine("e", fail={1: "down", 2: "abort", 3: "refuse", 4: "length"})

    def reward(sample):
        if sample.label == "5":
            raise KeyError("no judge for 5")
        return math_reward(sample)

    result = asyncio.run(rollout_groups([engine], items(7), 3, SAMPLING, reward, max_concurrency=4))
    assert [g[0].group_index for g in result.groups] == [0, 4, 6]
    assert all(len(g) == 3 and [s.index for s in g] == [0, 1, 2] for g in result.groups)
    assert all(s.reward == 1.0 for g in result.groups for s in g)
    assert [it.index for it in result.requeue] == [1, 2]  # engine gone / aborted: retried later
    assert [it.index for it in result.dropped] == [3, 5]  # refused / reward failed: for good
    assert result.num_aborted_groups == 2 and result.num_reward_errors == 1
    assert result.num_engine_refusals == 1 and result.num_truncated == 3
    assert all(s.status is Status.ABORTED for s in result.aborted_groups[0])
    assert "ConnectError" in result.aborted_groups[0][0].metadata["abort_reason"]
    assert "no judge for 5" in result.failed_groups[1][0].metadata["reward_error"]
    assert "prompt too long" in result.failed_groups[0][0].metadata["engine_error"]
    assert engine.max_in_flight <= 4

    m = rollout_metrics(result)
    assert m["num_groups"] == 3 and m["num_samples"] == 9
    assert m["reward_mean"] == 1.0 and m["reward_std"] == 0.0
    assert m["truncated_frac"] == pytest.approx(1 / 3)
    assert m["response_len_max"] == 4 and m["aborted_groups"] == 2 and m["reward_errors"] == 1
    assert m["prefix_cache_hit_rate"] == pytest.approx(1 / 3)
    assert m["tokens_per_s"] > 0

    retried = asyncio.run(rollout_groups([FakeEngine("e")], items(7)[5:6], 2, SAMPLING, reward,
                                         retry_reward_errors=True))
    assert [it.index for it in retried.requeue] == [5] and not retried.dropped


def test_every_group_failing_for_good_raises():
    def broken(sample):
        raise NameError("typo")

    with pytest.raises(RolloutError, match="NameError: typo"):
        asyncio.run(rollout_groups([FakeEngine("e")], items(3), 2, SAMPLING, broken))
    with pytest.raises(RolloutError, match="prompt too long"):
        asyncio.run(rollout_groups([FakeEngine("e", fail={0: "refuse"})], items(1), 2, SAMPLING,
                                   math_reward))
    # an engine answering outside the protocol is a bug: it propagates, nothing keeps running
    with pytest.raises(EngineProtocolError, match="unknown finish_reason"):
        asyncio.run(rollout_groups([FakeEngine("e", fail={0: "garbage"})], items(3), 2, SAMPLING,
                                   math_reward))


def test_groups_spread_round_robin_and_group_fn():
    engines = [FakeEngine("a"), FakeEngine("b")]
    result = asyncio.run(rollout_groups(engines, items(4), 2, SAMPLING, None,
                                        group_reward_fn=lambda g: [0.0, 1.0],
                                        group_index_start=10))
    assert sorted(engines[0].prompts) == [0, 0, 2, 2] and sorted(engines[1].prompts) == [1, 1, 3, 3]
    assert [g[0].group_index for g in result.groups] == [10, 11, 12, 13]
    assert [s.reward for s in result.groups[0]] == [0.0, 1.0]
    with pytest.raises(ValueError, match="give a reward_fn"):
        asyncio.run(rollout_groups(engines, items(1), 2, SAMPLING, None))
