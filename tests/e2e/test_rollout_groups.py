"""The default rollout fn against real `milepost serve` processes: token-exact groups, rewards,
metrics; an engine killed mid-rollout gives ABORTED samples and requeued prompts, not a crash."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from milepost.data.source import PromptDataset
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import SamplingSettings, rollout_groups, rollout_metrics
from milepost.rollout.rewards import math_reward
from milepost.types import Status


@pytest.fixture
def dataset(tmp_path, qwen3_tokenizer):
    rows = [{"prompt": f"What is {a}+{b}? " * 3, "label": str(a + b)} for a, b in
            [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2)]]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset.from_file(path, qwen3_tokenizer, seed=1)


def test_rollout_groups_token_exact(qwen3_server, dataset):
    items = dataset.next_batch(4)
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=12)

    async def go():
        async with EngineClient(qwen3_server.url, 60) as a, EngineClient(qwen3_server.url, 60) as b:
            version = await a.get_weight_version()
            return version, await rollout_groups([a, b], items, 3, sampling, math_reward,
                                                 max_concurrency=5)

    version, result = asyncio.run(go())
    assert len(result.groups) == 4 and not result.requeue and not result.dropped
    for item, group in zip(items, result.groups):
        assert len(group) == 3
        for k, s in enumerate(group):
            out = s.response_ids
            assert s.tokens == item.prompt_ids + out and s.prompt_length == len(item.prompt_ids)
            assert 1 <= s.response_length <= 12 and len(out) == s.response_length
            assert len(s.rollout_logprobs) == len(s.loss_mask) == s.response_length
            assert s.weight_versions == [version] * s.response_length
            assert all(lp <= 0 for lp in s.rollout_logprobs)
            # A sample may also stop (EOS) exactly on its 12th token: the finish reason decides.
            truncated = s.metadata["finish_reason"]["type"] == "length"
            assert s.status is (Status.TRUNCATED if truncated else Status.COMPLETED)
            assert not truncated or s.response_length == 12
            assert s.reward in (0.0, 1.0) and s.index == k and s.label == item.label
    m = rollout_metrics(result)
    assert m["num_samples"] == 12 and 0 <= m["reward_mean"] <= 1
    assert m["truncated_frac"] == result.num_truncated / 12
    assert 0 < m["prefix_cache_hit_rate"] < 1  # later samples of a group reuse its prompt
    assert m["tokens_per_s"] > 0


def test_engine_killed_mid_rollout(start_server, qwen3_dir, dataset):
    srv = start_server(qwen3_dir, "--max-total-tokens", "16384")
    items = dataset.next_batch(4)
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=1500)

    async def go():
        async with EngineClient(srv.url, 30, generate_retries=1, retry_backoff_s=0.05) as c:
            task = asyncio.ensure_future(
                rollout_groups([c], items, 4, sampling, math_reward, max_concurrency=16))
            # Idle, 4 requests run within a second; a loaded machine was seen 30x slower: poll
            # the condition with a generous limit (the pytest timeout bounds the whole test).
            deadline = time.monotonic() + 180
            while (await c.get_server_info())["num_running_reqs"] < 4:
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            srv.proc.kill()
            return await asyncio.wait_for(task, 180)

    result = asyncio.run(go())
    assert result.num_aborted_groups >= 1
    assert len(result.groups) + result.num_aborted_groups == 4 and not result.dropped
    assert [it.index for it in result.requeue] == [g[0].metadata["prompt_index"]
                                                   for g in result.aborted_groups]
    aborted = [s for g in result.aborted_groups for s in g if s.status is Status.ABORTED]
    assert aborted and all("abort_reason" in s.metadata for s in aborted)
    assert all(s.reward is None for g in result.aborted_groups for s in g)  # never scored
    dataset.requeue(result.requeue)
    assert [it.index for it in dataset.next_batch(len(result.requeue))] == \
        [it.index for it in result.requeue]
    assert rollout_metrics(result)["aborted_groups"] == result.num_aborted_groups
