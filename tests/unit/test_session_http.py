"""Session server over HTTP without an engine: an engine that cannot be reached is a 503 with a
message and leaves the session untouched; validation happens before any engine call."""

from __future__ import annotations

import httpx

from milepost.launch.process import free_port
from milepost.session.runner import SessionServerThread
from milepost.testing.tokenizer import build_tiny_tokenizer


def test_engine_down_is_503_and_stores_nothing() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with SessionServerThread(build_tiny_tokenizer(), dead, family="qwen3") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        sid = c.post("/sessions").json()["session_id"]
        before = c.get(f"/sessions/{sid}").json()
        r = c.post(f"/sessions/{sid}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "unavailable" in r.json()["error"]["message"]
        assert c.get(f"/sessions/{sid}").json() == before
        assert c.post(f"/sessions/{sid}/samples").json() == {"samples": []}
        r = c.post(f"/sessions/{sid}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "temperature": -1})
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


def test_non_finite_numbers_and_lone_surrogates_are_400() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    url = "/sessions/{}/v1/chat/completions"
    with SessionServerThread(build_tiny_tokenizer(), dead, family="qwen3") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        sid = c.post("/sessions").json()["session_id"]
        for raw, needle in [
            ('{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
             "temperature"),
            ('{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', "top_p"),
            ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
            ('{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}', "model"),
        ]:
            r = c.post(url.format(sid), content=raw.encode(),
                       headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.text)
            assert needle in r.json()["error"]["message"], r.json()
        assert c.get("/health").status_code == 200


def test_openai_fields_are_honoured_or_refused_by_name() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with SessionServerThread(build_tiny_tokenizer(), dead, family="qwen3") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        sid = c.post("/sessions").json()["session_id"]
        url = f"/sessions/{sid}/v1/chat/completions"
        msgs = [{"role": "user", "content": "hi"}]
        for extra, needle in [
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
            ({"parallel_tool_calls": False}, "parallel_tool_calls"),
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
            ({"logprobs": True, "stream": True}, "logprobs with stream"),
            ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
            ({"top_k": -2}, "top_k"), ({"frequency_penalty": 3}, "frequency_penalty"),
        ]:
            r = c.post(url, json={"messages": msgs, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert needle in r.json()["error"]["message"], r.json()
        # Their no-op values pass validation and reach the engine (down here: 503).
        r = c.post(url, json={"messages": msgs, "tool_choice": "auto", "parallel_tool_calls": True,
                              "response_format": {"type": "text"}, "top_logprobs": 0,
                              "top_k": 5, "seed": 1, "chat_template_kwargs": {"x": 1}})
        assert r.status_code == 503, r.text


def test_malformed_messages_are_400_naming_the_message_and_field() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    ask = {"role": "user", "content": "Weather?"}
    with SessionServerThread(build_tiny_tokenizer(), dead, family="qwen3") as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        sid = c.post("/sessions").json()["session_id"]
        url = f"/sessions/{sid}/v1/chat/completions"
        for messages, needles in [
            ([ask, {"role": "assistant", "content": "", "tool_calls": [call]}, ask],
             ["messages.1.tool_calls.0.id"]),
            ([ask, {"role": "assistant", "content": "", "tool_calls": [
                {**call, "id": "c1", "function": {"arguments": "{}"}}]}, ask],
             ["messages.1.tool_calls.0.function.name"]),
            ([{"role": "developer-ish", "content": "x"}], ["messages.0.role"]),
            ([ask, {"role": "assistant", "tool_calls": "get_weather"}, ask],
             ["messages.1.tool_calls"]),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
             ["messages.0.content"]),
        ]:
            r = c.post(url, json={"messages": messages})
            assert r.status_code == 400, (messages, r.text)
            assert all(n in r.json()["error"]["message"] for n in needles), r.json()
        assert c.get(f"/sessions/{sid}").json()["turns"] == []
