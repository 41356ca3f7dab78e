"""The session server against a real engine serving a tiny tool-calling model: token exactness
across turns under every matcher with a harness that rewrites its replays, linear vs branching,
streaming, and bad input (4xx with a message; stored history unchanged)."""

from __future__ import annotations

import json

import httpx
import pytest

from milepost.session.runner import SessionServerThread
from milepost.session.service import SessionSettings
from milepost.testing.agent_harness import RecordingTransport, WeatherAgent
from milepost.testing.server_process import ServerProcess


@pytest.fixture(scope="module")
def engine(agent_engine: ServerProcess) -> ServerProcess:
    return agent_engine  # one engine for every session test (tests/e2e/conftest.py)


def _server(agent_dir, engine, matcher="strict", mode="linear", recorder=None):
    return SessionServerThread(agent_dir, engine.url, family="qwen3", matcher=matcher,
                               settings=SessionSettings(mode=mode),
                               engine_transport=recorder)


def _assert_token_exact(samples: list[dict], calls: list[tuple[dict, dict, dict]],
                        session_id: str) -> None:
    """Each sample's sampled tokens are exactly the output ids of the engine calls on its path,
    in order, and each of those calls saw exactly the sample's tokens before it as its prompt."""
    mine = [(req, out) for req, out, headers in calls
            if headers.get("x-smg-routing-key") == session_id]
    assert mine, "every session call carries its routing key"
    for s in samples:
        tokens, n_prompt = s["tokens"], len(s["tokens"]) - s["response_length"]
        on_path = [(req, out) for req, out in mine
                   if tokens[:len(req["input_ids"]) + len(out["output_ids"])]
                   == req["input_ids"] + out["output_ids"]]
        on_path.sort(key=lambda c: len(c[0]["input_ids"]))
        engine_ids = [t for _, out in on_path for t in out["output_ids"]]
        engine_lp = [e[0] for _, out in on_path for e in out["meta_info"]["output_token_logprobs"]]
        sampled = [t for t, m in zip(tokens[n_prompt:], s["loss_mask"]) if m]
        sampled_lp = [lp for lp, m in zip(s["rollout_logprobs"], s["loss_mask"]) if m]
        assert sampled == engine_ids
        assert sampled_lp == engine_lp
        assert len(on_path) == s["metadata"]["turns"]
        end = on_path[-1]
        assert tokens == end[0]["input_ids"] + end[1]["output_ids"]


# (matcher, reserialize, drop reasoning) -> lineages a branching session must keep
CASES = [("strict", False, False, 1), ("strict", True, True, 3),
         ("json_args", True, False, 1), ("json_args", True, True, 3),
         ("loose", True, True, 1)]


@pytest.mark.parametrize("matcher,reserialize,drop,leaves", CASES)
def test_token_exact_under_every_matcher(agent_dir, engine, matcher, reserialize, drop, leaves):
    rec = RecordingTransport()
    with _server(agent_dir, engine, matcher, "branching", rec) as srv, httpx.Client(
            base_url=srv.url, timeout=120) as c:
        sid = c.post("/sessions").json()["session_id"]
        agent = WeatherAgent(f"/sessions/{sid}/v1", reserialize_args=reserialize,
                             drop_reasoning=drop, sampling={"max_tokens": 96, "temperature": 0})
        agent.run("Oslo", c)
        assert agent.answers[0]["choices"][0]["finish_reason"] == "tool_calls"
        assert len(agent.answers) == 3  # tool call, answer, "you are welcome"
        samples = c.post(f"/sessions/{sid}/samples").json()["samples"]
        assert len(samples) == leaves
        _assert_token_exact(samples, rec.generate_calls, sid)
        if leaves == 1:
            assert samples[0]["metadata"]["turns"] == 3
            cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in agent.answers]
            assert all(x > 0 for x in cached[1:])  # later turns reuse the engine's prefix


def test_linear_accepts_equivalent_replays_and_refuses_divergent_ones(agent_dir, engine):
    with _server(agent_dir, engine, "json_args", "linear") as srv, httpx.Client(
            base_url=srv.url, timeout=120) as c:
        sid = c.post("/sessions").json()["session_id"]
        agent = WeatherAgent(f"/sessions/{sid}/v1", reserialize_args=True,
                             sampling={"max_tokens": 96, "temperature": 0})
        agent.run("Rome", c)
        before = c.get(f"/sessions/{sid}").json()
        assert len(before["turns"]) == 3 and len(before["leaves"]) == 1
        bad = json.loads(json.dumps(agent.messages))
        bad[0]["content"] = "Weather in Lima?"
        r = c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": bad + [
            {"role": "user", "content": "again"}]})
        assert r.status_code == 409 and "diverges" in r.json()["error"]["message"]
        after = c.get(f"/sessions/{sid}").json()
        (rejected,) = after.pop("divergences")  # recorded, and nothing else changed
        assert (rejected["kind"], rejected["message"], rejected["field"]) == (
            "rejected", 0, "content")
        assert before.pop("divergences") == [] and after == before
        (sample,) = c.post(f"/sessions/{sid}/samples").json()["samples"]
        assert sample["metadata"]["turns"] == 3


def test_bad_input_is_4xx_with_a_message(agent_dir, engine):
    with _server(agent_dir, engine) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        sid = c.post("/sessions").json()["session_id"]
        url = f"/sessions/{sid}/v1/chat/completions"
        for body, needle in [
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
            ({"messages": [{"role": "user", "content": "x"},
                           {"role": "tool", "content": "y"}]}, "tool_call_id"),
            ({"messages": [{"role": "user", "content": "x"},
                           {"role": "assistant", "content": "y"}]}, "last message"),
            ({"messages": [{"role": "user"}]}, "needs content"),
            ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ]:
            r = c.post(url, json=body)
            assert r.status_code == 400, body
            assert needle in r.json()["error"]["message"], r.json()
        assert c.post(url, content=b"{not json", headers={"content-type": "application/json"}
                      ).status_code == 400
        assert c.post("/sessions/nope/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}]}).status_code == 404
        assert c.get("/sessions/nope").status_code == 404
        # A turn cut by the length limit cannot be extended; the session keeps its one turn.
        msgs = [{"role": "user", "content": "Weather in Bern?"}]
        # Greedy: a sampled reply may end (EOS) within 3 tokens; the greedy one is long.
        r = c.post(url, json={"messages": msgs, "max_tokens": 3, "temperature": 0})
        assert r.json()["choices"][0]["finish_reason"] == "length", r.json()
        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
        r = c.post(url, json={"messages": msgs})
        assert r.status_code == 409 and "length limit" in r.json()["error"]["message"]
        (s,) = c.post(f"/sessions/{sid}/samples").json()["samples"]
        assert s["status"] == "truncated" and sum(s["loss_mask"]) == 3
        assert c.post(f"/sessions/{sid}/samples", json={"leaves": [42]}).status_code == 409
        assert c.delete(f"/sessions/{sid}").status_code == 200
        assert c.delete(f"/sessions/{sid}").status_code == 404


def test_stream_chunks_rebuild_the_message(agent_dir, engine):
    with _server(agent_dir, engine) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        sid = c.post("/sessions").json()["session_id"]
        r = c.post(f"/sessions/{sid}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Weather in Paris?"}], "stream": True,
            "temperature": 0, "max_tokens": 96})
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        assert r.text.rstrip().endswith("data: [DONE]")
        deltas = [e["choices"][0]["delta"] for e in events]
        calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
        assert calls and "city" in json.loads(calls[0]["function"]["arguments"])
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        stored = c.get(f"/sessions/{sid}").json()["messages"][-1]
        assert stored["tool_calls"][0]["id"] == calls[0]["id"]
