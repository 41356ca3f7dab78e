"""EngineClient against a fake transport: SGLang's response as a real SGLang server sends it,
the routing header, error classes, retries, `success: false`, and the sync wrapper."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from milepost.rollout.client import (
    ROUTING_KEY_HEADER,
    EngineClient,
    EngineProtocolError,
    EngineRequestError,
    EngineUnavailableError,
    SyncEngineClient,
    parse_generate,
)

# A real SGLang server's answer: no output_token_weight_versions, bare logprob entries.
SGLANG_ANSWER = {
    "text": " Paris",
    "output_ids": [12, 40, 2],
    "meta_info": {
        "id": "abc", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 5,
        "completion_tokens": 3, "cached_tokens": 4, "weight_version": "7",
        "output_token_logprobs": [[-0.5, 12, None], [-1.25, 40, None], [-0.01, 2, None]],
        "e2e_latency": 0.1,
    },
}


def run(coro):
    return asyncio.run(coro)


def client_with(handler, **kw) -> EngineClient:
    return EngineClient("http://engine:1", 5.0, transport=httpx.MockTransport(handler), **kw)


def test_parse_real_sglang_answer_fills_versions():
    out = parse_generate(SGLANG_ANSWER, "u", return_logprob=True)
    assert out.output_ids == [12, 40, 2] and out.logprobs == [-0.5, -1.25, -0.01]
    assert out.weight_versions == ["7", "7", "7"] and out.weight_version == "7"
    assert out.finish_reason == {"type": "stop", "matched": 2} and out.finish_type == "stop"
    assert (out.prompt_tokens, out.cached_tokens, out.rid, out.routed_experts) == (5, 4, "abc", None)

    ours = json.loads(json.dumps(SGLANG_ANSWER))
    ours["meta_info"]["output_token_weight_versions"] = ["6", "6", "7"]
    assert parse_generate(ours, "u", True).weight_versions == ["6", "6", "7"]


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b["meta_info"]["output_token_logprobs"].pop(), "token ids differ"),
    (lambda b: b["meta_info"].__setitem__("output_token_weight_versions", ["1"]),
     "1 output_token_weight_versions for 3 output_ids"),
    (lambda b: b.pop("output_ids"), "KeyError"),
])
def test_parse_refuses_inconsistent_answers(mutate, match):
    body = json.loads(json.dumps(SGLANG_ANSWER))
    mutate(body)
    with pytest.raises(EngineProtocolError, match=match):
        parse_generate(body, "u", True)


def test_generate_request_body_and_routing_header():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.url.path, req.headers.get(ROUTING_KEY_HEADER), json.loads(req.content)))
        return httpx.Response(200, json=SGLANG_ANSWER)

    async def go():
        async with client_with(handler) as c:
            await c.generate([1, 2, 3], {"max_new_tokens": 3}, routing_key="session-9", rid="r1")
            await c.generate([1], {"max_new_tokens": 3}, return_logprob=False,
                             return_routed_experts=True)

    run(go())
    path, key, body = seen[0]
    assert path == "/generate" and key == "session-9"
    assert body == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3},
                    "return_logprob": True, "rid": "r1"}
    assert seen[1][1] is None and seen[1][2]["return_routed_experts"] is True
    assert "rid" not in seen[1][2]


def test_errors_split_by_cause_and_generate_retries():
    calls = []

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(json.loads(req.content).get("rid"))
        if req.url.path == "/bad":
            return httpx.Response(400, json={"error": {"message": "input_ids: empty"}})
        if len(calls) < 3:
            return httpx.Response(503, json={"error": {"message": "the engine stopped"}})
        return httpx.Response(200, json=SGLANG_ANSWER)

    async def go():
        async with client_with(handler, generate_retries=2, retry_backoff_s=0.001) as c:
            out = await c.generate([1], {}, rid="x")
            assert out.output_ids == [12, 40, 2]
            assert calls == ["x", "x-retry1", "x-retry2"]  # retries stay reachable by abort(x)
            calls.clear()
            c.generate_retries = 1
            with pytest.raises(EngineUnavailableError, match="503: the engine stopped") as e:
                await c.generate([1], {})
            assert e.value.status == 503 and len(calls) == 2
            with pytest.raises(EngineRequestError, match="input_ids: empty") as e:
                await c._request("POST", "/bad", {})
            assert e.value.message == "input_ids: empty" and e.value.status == 400

    run(go())


def test_success_false_is_a_refusal_and_timeouts_are_unavailable():
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/update_weights_from_disk":
            return httpx.Response(200, json={"success": False, "message": "no such dir"})
        if req.url.path == "/get_weight_version":
            raise httpx.ReadTimeout("slow", request=req)
        raise httpx.ConnectError("refused", request=req)

    async def go():
        async with client_with(handler, generate_retries=0) as c:
            with pytest.raises(EngineRequestError, match="no such dir"):
                await c.update_weights_from_disk("/nowhere")
            with pytest.raises(EngineUnavailableError, match="timed out"):
                await c.get_weight_version()
            with pytest.raises(EngineUnavailableError, match="ConnectError"):
                await c.generate([1], {})
            assert await c.health() is False
            with pytest.raises(ValueError, match="give a rid, or abort_all"):
                await c.abort_request()

    run(go())


def test_sync_client_works_inside_and_outside_an_event_loop():
    with SyncEngineClient("http://engine:1", 5.0,
                          transport=httpx.MockTransport(
                              lambda r: httpx.Response(200, json={"weight_version": "3"}))) as c:
        assert c.get_weight_version() == "3"

        async def inside() -> str:
            return c.get_weight_version()

        assert asyncio.run(inside()) == "3"
        assert c.get_weight_version.__doc__ == EngineClient.get_weight_version.__doc__
