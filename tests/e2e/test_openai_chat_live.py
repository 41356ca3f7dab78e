"""The engine's `/v1/chat/completions` honours or refuses every OpenAI field (issue 16): a tiny
tool-calling model taught with the tool list in its prompt, behind `milepost serve
--tool-call-parser qwen3`, and the real sglang-router in front of it (the router rewrites
`max_tokens` into `max_completion_tokens`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from milepost.launch.process import ManagedProcess, free_port
from milepost.testing.agent_model import CITIES, WEATHER_TOOL, make_agent_model
from milepost.testing.server_process import ServerProcess

ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 80}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_agent_model(tmp_path_factory.getbasetemp() / "agent_model_tools",
                            tools=[WEATHER_TOOL])


@pytest.fixture(scope="module")
def tok(model: Path):
    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[ServerProcess]:
    with ServerProcess(model, "--max-total-tokens", "16384", "--tool-call-parser", "qwen3") as srv:
        yield srv


def chat(srv: ServerProcess | str, **body) -> httpx.Response:
    url = srv if isinstance(srv, str) else srv.url
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"X-SMG-Routing-Key": "k"})


def events(r: httpx.Response) -> list[dict]:
    assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    return [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]


def prompt_len(tok, messages: list[dict], **kw) -> int:
    return len(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                       return_dict=False, **kw))


def test_tools_rendered_calls_parsed_plain_and_streamed(engine, tok) -> None:
    r = chat(engine, messages=ASK, tools=[WEATHER_TOOL], **GREEDY)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["prompt_tokens"] == prompt_len(tok, ASK, tools=[WEATHER_TOOL])
    choice = out["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls", msg
    assert msg["reasoning_content"] == "I should call the tool."
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"]
    # (a model this small does not always copy the city: any of its cities is a parsed call)
    assert json.loads(call["function"]["arguments"])["city"] in CITIES

    # The same request streamed: the deltas add up to the same message, the call comes whole.
    r = chat(engine, messages=ASK, tools=[WEATHER_TOOL], stream=True,
             stream_options={"include_usage": True}, **GREEDY)
    assert r.status_code == 200, r.text
    evs = events(r)
    deltas = [c["delta"] for e in evs for c in e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"] for c in calls] == [call["function"]]
    assert [c["finish_reason"] for e in evs for c in e["choices"] if c["finish_reason"]] == \
        ["tool_calls"]
    assert evs[-1]["usage"]["completion_tokens"] == out["usage"]["completion_tokens"]

    # The harness answers the call (arguments as the JSON string OpenAI carries): a sentence.
    history = ASK + [msg, {"role": "tool", "tool_call_id": call["id"], "content": "snow"}]
    r = chat(engine, messages=history, tools=[WEATHER_TOOL], **GREEDY)
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]["message"]["content"]
    assert reply.startswith("It is ") and reply.endswith(".") and "tool_call" not in reply, reply
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_none_and_template_kwargs_change_the_prompt(engine, tok) -> None:
    r = chat(engine, messages=ASK, tools=[WEATHER_TOOL], tool_choice="none", **GREEDY)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == prompt_len(tok, ASK)
    assert "tool_calls" not in r.json()["choices"][0]["message"]
    r = chat(engine, messages=ASK, chat_template_kwargs={"enable_thinking": False}, **GREEDY)
    assert r.status_code == 200, r.text
    want = prompt_len(tok, ASK, enable_thinking=False)
    assert want > prompt_len(tok, ASK) and r.json()["usage"]["prompt_tokens"] == want


def test_sampling_fields_and_logprobs_reach_the_engine(engine, tok) -> None:
    greedy = chat(engine, messages=ASK, temperature=0, max_tokens=12).json()
    top1 = chat(engine, messages=ASK, temperature=1.0, top_k=1, seed=3, max_tokens=12).json()
    assert top1["choices"][0]["message"] == greedy["choices"][0]["message"]

    r = chat(engine, messages=ASK, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    ids = tok.apply_chat_template(ASK, tokenize=True, add_generation_prompt=True, return_dict=False)
    ref = httpx.post(f"{engine.url}/generate", timeout=60, json={
        "input_ids": list(ids), "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6}}).json()
    assert len(content) == len(ref["output_ids"]) == 6
    for entry, (lp, tid, _) in zip(content, ref["meta_info"]["output_token_logprobs"]):
        assert entry["token"] == tok.decode([tid]) and entry["logprob"] == pytest.approx(lp, abs=1e-4)
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] >= \
            entry["top_logprobs"][1]["logprob"]

    r = chat(engine, messages=ASK, temperature=1.0, max_tokens=4, n=2, stream=True)
    finished = sorted(c["index"] for e in events(r) for c in e["choices"] if c["finish_reason"])
    assert finished == [0, 1]


def test_max_completion_tokens_directly_and_through_sglang_router(engine, tmp_path) -> None:
    r = chat(engine, messages=ASK, temperature=0, max_completion_tokens=3)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--worker-urls", engine.url, "--policy", "manual",
           "--assignment-mode", "min_load", "--log-level", "warn", "--prometheus-host",
           "127.0.0.1", "--prometheus-port", str(free_port())]
    with ManagedProcess("router", cmd, tmp_path / "router.log", f"http://127.0.0.1:{port}/health",
                        timeout_s=120):
        # The router forwards max_completion_tokens plus SGLang's flags at their defaults.
        r = chat(f"http://127.0.0.1:{port}", messages=ASK, temperature=0, max_tokens=3)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        # /v1/completions gets SGLang's flags too (echo, no_stop_trim, ...): accepted.
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       headers={"X-SMG-Routing-Key": "k"},
                       json={"model": "default", "prompt": "Weather in Oslo?", "max_tokens": 3,
                             "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        r = chat(f"http://127.0.0.1:{port}", messages=ASK, tools=[WEATHER_TOOL], **GREEDY)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == \
            "get_weather"


@pytest.mark.parametrize("extra, words", [
    ({"functions": [WEATHER_TOOL["function"]]}, ["functions", "unknown field"]),
    ({"tool_choice": "required", "tools": [WEATHER_TOOL]}, ["tool_choice", "required"]),
    ({"parallel_tool_calls": False}, ["parallel_tool_calls"]),
    ({"top_logprobs": 2}, ["top_logprobs", "logprobs"]),
    ({"logprobs": True, "stream": True}, ["logprobs", "stream"]),
    ({"max_tokens": 3, "max_completion_tokens": 4}, ["max_completion_tokens", "max_tokens"]),
    ({"return_hidden_states": True}, ["return_hidden_states"]),
    ({"chat_template_kwargs": {"tools": []}}, ["chat_template_kwargs", "tools"]),
    ({"top_k": -5}, ["top_k"]),
    ({"messages": ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]},
     ["messages[1].tool_calls[0].id"]),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, ["messages[1].tool_call_id"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     ["messages[0].content"]),
])
def test_unsupported_or_malformed_fields_are_400_naming_them(engine, extra, words) -> None:
    r = chat(engine, **{"messages": ASK, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_fields_that_change_nothing_are_accepted(engine) -> None:
    r = chat(engine, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
             max_tokens=2, user="u-1", metadata={"run": "x"}, store=False)
    assert r.status_code == 200, r.text


def test_tools_without_a_parser_are_refused(qwen3_server) -> None:
    r = chat(qwen3_server, messages=ASK, tools=[WEATHER_TOOL], max_tokens=2)
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"], r.text
