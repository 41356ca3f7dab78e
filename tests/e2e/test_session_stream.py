"""Token-by-token streaming through the session server, with the official `openai` client against
a real engine on loopback: real deltas (reasoning, content, tool calls) as the engine produces
them, the stored turn is the engine's tokens exactly, a client that leaves mid-stream drops the
turn without touching the session, and an engine refusal is still a 4xx before any chunk."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from milepost.session.runner import SessionServerThread
from milepost.testing.agent_harness import RecordingTransport
from milepost.testing.server_process import ServerProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def engine(agent_engine: ServerProcess) -> ServerProcess:
    return agent_engine  # one engine for every session test (tests/e2e/conftest.py)


class SlowEngineTransport(httpx.AsyncBaseTransport):
    """The network, with each streamed engine chunk held back `delay_s` (so a test can leave
    mid-generation on a fast tiny model); counts the chunks that reached the session server."""

    def __init__(self, delay_s: float) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.delay_s = delay_s
        self.chunks = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if not request.url.path.endswith("/generate"):
            return response
        outer = self

        class Slow(httpx.AsyncByteStream):
            async def __aiter__(self):
                async for part in response.aiter_raw():
                    await asyncio.sleep(outer.delay_s)
                    outer.chunks += 1
                    yield part

            async def aclose(self) -> None:
                await response.aclose()

        return httpx.Response(response.status_code, headers=response.headers, stream=Slow())


def _weather_turns(client, city: str = "Oslo") -> tuple[list[dict], list]:
    """Turn 1 (tool call) without streaming; turn 2 (reasoning + answer) streamed."""
    messages: list[dict] = [{"role": "user", "content": f"Weather in {city}?"}]
    first = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                           max_tokens=96)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "snow"}]
    stream = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                            max_tokens=96, stream=True,
                                            stream_options={"include_usage": True})
    return messages, list(stream)


def test_openai_client_gets_token_deltas_that_rebuild_the_stored_turn(agent_dir, engine):
    rec = RecordingTransport()
    with SessionServerThread(agent_dir, engine.url, family="qwen3",
                             engine_transport=rec) as srv:
        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        client = openai.OpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key="unused")
        _, chunks = _weather_turns(client)
        with_choice = [c for c in chunks if c.choices]
        deltas = [c.choices[0].delta for c in with_choice]
        reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
        content = [d.content or "" for d in deltas]
        # Real deltas: several pieces each, not one block at the end.
        assert sum(bool(r) for r in reasoning) >= 2 and sum(bool(c) for c in content) >= 2
        assert with_choice[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        stored = httpx.get(f"{srv.url}/sessions/{sid}").json()
        assert stored["pending_turns"] == 0 and len(stored["turns"]) == 2
        reply = stored["messages"][-1]
        assert "".join(content) == reply["content"]
        assert "".join(reasoning) == reply["reasoning_content"]
        # The checkpoint is the engine's streamed tokens, exactly, written once.
        (sample,) = httpx.post(f"{srv.url}/sessions/{sid}/samples").json()["samples"]
        req, out, _ = rec.generate_calls[-1]
        assert req["stream"] is True and out["meta_info"]["finish_reason"]["type"] == "stop"
        assert sample["tokens"] == req["input_ids"] + out["output_ids"]
        n = len(out["output_ids"])
        assert sample["loss_mask"][-n:] == [1] * n
        assert sample["rollout_logprobs"][-n:] == [
            e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert usage_matches(chunks[-1].usage, out)


def usage_matches(usage, out: dict) -> bool:
    return usage.completion_tokens == len(out["output_ids"])


def test_streamed_tool_call_has_the_stored_id(agent_dir, engine):
    with SessionServerThread(agent_dir, engine.url, family="qwen3") as srv:
        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        client = openai.OpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key="unused")
        chunks = list(client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Weather in Lima?"}],
            temperature=0, max_tokens=96, stream=True))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert len(calls) == 1 and calls[0].index == 0
        assert "city" in json.loads(calls[0].function.arguments)  # the tiny model may pick another
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        stored = httpx.get(f"{srv.url}/sessions/{sid}").json()["messages"][-1]
        assert stored["tool_calls"][0]["id"] == calls[0].id


def test_client_leaving_mid_stream_drops_the_turn(agent_dir, engine):
    slow = SlowEngineTransport(delay_s=0.3)
    with SessionServerThread(agent_dir, engine.url, family="qwen3",
                             engine_transport=slow) as srv:
        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        url = f"{srv.url}/sessions/{sid}/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Weather in Rome?"}],
                "temperature": 0, "max_tokens": 96, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(2)]  # role chunk + blank line: generation started
            assert got[0].startswith("data: ")
        # The client is gone: the turn is dropped, the engine request ends, the lock is free.
        deadline = time.monotonic() + 180  # idle: ~1 s (the disconnect poll); loaded: far slower
        while httpx.get(f"{srv.url}/sessions/{sid}").json()["pending_turns"]:
            assert time.monotonic() < deadline, "the abandoned turn never ended"
            time.sleep(0.1)
        assert httpx.get(f"{srv.url}/sessions/{sid}").json()["turns"] == []
        seen = slow.chunks
        time.sleep(1.0)
        assert slow.chunks == seen  # nothing more comes from the engine for that turn
        slow.delay_s = 0.0
        again = httpx.post(url, json={**body, "stream": False}, timeout=60)
        assert again.status_code == 200  # the linear session takes the same request again
        summary = httpx.get(f"{srv.url}/sessions/{sid}").json()
        assert len(summary["turns"]) == 1 and summary["pending_turns"] == 0


def test_engine_refusal_is_a_4xx_before_any_chunk(agent_dir, engine):
    with SessionServerThread(agent_dir, engine.url, family="qwen3") as srv:
        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        r = httpx.post(f"{srv.url}/sessions/{sid}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "max_tokens": 10 ** 6, "stream": True}, timeout=60)
        assert r.status_code == 400 and "engine refused" in r.json()["error"]["message"]
        summary = httpx.get(f"{srv.url}/sessions/{sid}").json()
        assert summary["turns"] == [] and summary["pending_turns"] == 0


def _rebuild(chunks: list) -> dict:
    """The assistant message a streaming harness rebuilds from its chunks."""
    msg: dict = {"role": "assistant", "content": "", "reasoning_content": ""}
    calls: dict[int, dict] = {}
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        msg["content"] += d.content or ""
        msg["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                               "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += tc.function.name or ""
            call["function"]["arguments"] += tc.function.arguments or ""
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    if not msg["reasoning_content"]:
        del msg["reasoning_content"]
    return msg


def test_a_streaming_tool_loop_extends_one_linear_lineage(agent_dir, engine):
    """Every turn streamed; the harness replays what it rebuilt from the deltas, and the linear
    session (strict matcher) extends turn after turn: the stream told it exactly what was stored."""
    with SessionServerThread(agent_dir, engine.url, family="qwen3") as srv:
        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        client = openai.OpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key="unused")
        messages: list[dict] = [{"role": "user", "content": "Weather in Tokyo?"}]
        for _ in range(3):
            chunks = list(client.chat.completions.create(
                model="m", messages=messages, temperature=0, max_tokens=96, stream=True))
            msg = _rebuild(chunks)
            messages.append(msg)
            for call in msg.get("tool_calls", []):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "rain"})
            if not msg.get("tool_calls"):
                messages.append({"role": "user", "content": "Thanks!"})
        summary = httpx.get(f"{srv.url}/sessions/{sid}").json()
        assert [t["id"] for t in summary["turns"]] == [1, 2, 3] and summary["leaves"] == [3]
        keys = ("content", "reasoning_content", "tool_calls")
        stored = [{k: m.get(k) for k in keys} for m in summary["messages"]
                  if m["role"] == "assistant"]
        rebuilt = [{k: m.get(k) for k in keys} for m in messages if m["role"] == "assistant"]
        assert stored == rebuilt  # what the client rebuilt from the deltas is what was stored
