"""EngineClient against a real `milepost serve` process: the generate parse, control endpoints,
4xx -> EngineRequestError with the engine's message, a dead server -> EngineUnavailableError."""

from __future__ import annotations

import asyncio

import pytest

from milepost.rollout.client import (
    EngineClient,
    EngineRequestError,
    EngineUnavailableError,
    SyncEngineClient,
)
from milepost.testing.server_process import free_port


def run(coro):
    return asyncio.run(coro)


def test_generate_parse(qwen3_server, qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("What is 2+3? " * 8)  # over one KV block: its prefix is cached

    async def go():
        async with EngineClient(qwen3_server.url, 60) as c:
            out = await c.generate(ids, {"max_new_tokens": 6, "temperature": 0.0,
                                         "ignore_eos": True})
            again = await c.generate(ids, {"max_new_tokens": 6, "temperature": 0.0,
                                           "ignore_eos": True}, routing_key="k")
            return out, again, await c.get_weight_version()

    out, again, version = run(go())
    assert len(out.output_ids) == 6 == len(out.logprobs) == len(out.weight_versions)
    assert out.finish_reason == {"type": "length", "length": 6} and out.finish_type == "length"
    assert all(lp <= 0 for lp in out.logprobs)
    assert out.weight_versions == [version] * 6 and out.weight_version == version
    assert out.prompt_tokens == len(ids)
    assert out.text == qwen3_tokenizer.decode(out.output_ids)
    assert again.output_ids == out.output_ids  # greedy: same tokens
    assert again.cached_tokens > 0  # the second request reused the first one's prefix


def test_request_errors_carry_the_engine_message(qwen3_server):
    async def go():
        async with EngineClient(qwen3_server.url, 60, generate_retries=0) as c:
            with pytest.raises(EngineRequestError) as e:
                await c.generate([1, 10**6], {"max_new_tokens": 2})
            assert e.value.status == 400
            assert "input_ids: token id 1000000 is outside the vocabulary" in e.value.message
            with pytest.raises(EngineRequestError, match="sampling_params.bogus: unknown field"):
                await c.generate([1, 2], {"bogus": 1})
            with pytest.raises(EngineRequestError, match=r"update_weights_from_disk.*weights "
                                                         "unchanged"):
                await c.update_weights_from_disk("/no/such/dir")

    run(go())


def test_control_endpoints(qwen3_server):
    async def go():
        async with EngineClient(qwen3_server.url, 60) as c:
            assert await c.health() is True
            before = await c.get_weight_version()
            info = await c.get_server_info()
            assert "num_running_reqs" in info and info["weight_version"] == before
            assert "vocab_size" in await c.get_model_info()
            assert "running" in (await c.metrics()).lower()
            await c.flush_cache()
            await c.pause_generation("in_place")
            await c.continue_generation()
            await c.abort_request(abort_all=True)
            await c.abort_request("no-such-rid")
            try:
                out = await c.update_weight_version("v-test")
                assert out["weight_version"] == "v-test"
                assert await c.get_weight_version() == "v-test"
                gen = await c.generate([1, 2, 3], {"max_new_tokens": 2, "ignore_eos": True})
                assert gen.weight_versions == ["v-test", "v-test"]
            finally:
                await c.update_weight_version(before)  # the server is shared
            with pytest.raises(EngineRequestError, match="group"):
                await c.destroy_weights_update_group("never-made")

    run(go())
    with SyncEngineClient(qwen3_server.url, 60) as sync:
        assert sync.health() is True
        assert isinstance(sync.get_weight_version(), str)


def test_dead_server_is_unavailable():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go():
        async with EngineClient(url, 5, generate_retries=1, retry_backoff_s=0.01) as c:
            with pytest.raises(EngineUnavailableError, match="ConnectError") as e:
                await c.generate([1, 2], {"max_new_tokens": 2})
            assert e.value.url == f"{url}/generate"
            with pytest.raises(EngineUnavailableError):
                await c.get_weight_version()
            assert await c.health() is False
            with pytest.raises(EngineUnavailableError, match="not healthy after"):
                await c.wait_healthy(timeout_s=0.2, poll_s=0.05)

    run(go())
