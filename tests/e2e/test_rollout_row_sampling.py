"""A prompt row's own `metadata.sampling_params` override the run's for its requests (the
long-tailed workload of benchmarks/async_vs_sync.py relies on it)."""

from __future__ import annotations

import asyncio

from milepost.data.source import PromptItem
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import SamplingSettings, generate_one
from milepost.types import Status


def test_row_sampling_params_set_each_prompts_length(qwen3_server, qwen3_tokenizer):
    ids = qwen3_tokenizer("count with me")["input_ids"]
    rows = [PromptItem(0, "short", ids, metadata={}),
            PromptItem(1, "long", ids, metadata={"sampling_params": {"max_new_tokens": 12,
                                                                    "ignore_eos": True}})]
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=3)

    async def go():
        async with EngineClient(qwen3_server.url) as client:
            return [await generate_one(client, item, sampling, 0) for item in rows]

    short, long = asyncio.run(go())
    assert short.response_length <= 3
    assert long.response_length == 12 and long.status is Status.TRUNCATED
    assert "sampling_params" in long.metadata  # the row's metadata is kept on the sample
