"""Issue 16's acceptance run: the official `openai` client drives a 4-turn tool-calling
conversation with reasoning through a linear session, and replays the model's messages the way
common harnesses do (reasoning_content dropped, tool-call arguments re-serialized). With the
matcher made for it every stored turn extends the previous one token for token and the trained
ids are the engine's; with `strict` the divergence is a 409 naming the message and field, or a
recorded rollback (header, response field, sample metadata) - never silent."""

from __future__ import annotations

import json

import httpx
import pytest

from milepost.session.divergence import HEADER
from milepost.session.runner import SessionServerThread
from milepost.session.service import SessionSettings
from milepost.testing.agent_harness import WEATHER, RecordingTransport
from milepost.testing.server_process import ServerProcess

openai = pytest.importorskip("openai")

USER_TURNS = ["Weather in Oslo?", "Thanks!", "Weather in Rome?"]


@pytest.fixture(scope="module")
def engine(agent_engine: ServerProcess) -> ServerProcess:
    return agent_engine  # one engine for every session test (tests/e2e/conftest.py)


def _replay(message) -> dict:
    """What a harness built on the openai client sends back: no reasoning, arguments re-dumped."""
    out: dict = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": json.dumps(
                json.loads(c.function.arguments or "{}"), separators=(",", ":"))}}
            for c in message.tool_calls]
    return out


def _converse(client, turns: int = 4) -> list:
    """`turns` model calls: tool results after a tool call, the next user message otherwise.
    Returns the raw responses (headers and parsed completion)."""
    users = iter(USER_TURNS)
    messages = [{"role": "user", "content": next(users)}]
    raws = []
    for _ in range(turns):
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=messages, temperature=0, max_tokens=96)
        raws.append(raw)
        msg = raw.parse().choices[0].message
        messages.append(_replay(msg))
        for call in msg.tool_calls or []:
            city = json.loads(call.function.arguments or "{}").get("city")
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": WEATHER.get(city, "unknown")})
        if not msg.tool_calls:
            messages.append({"role": "user", "content": next(users, "Bye")})
    return raws


def _server(agent_dir, engine, matcher, divergence, rec=None) -> SessionServerThread:
    return SessionServerThread(agent_dir, engine.url, family="qwen3", matcher=matcher,
                               settings=SessionSettings(mode="linear", divergence=divergence),
                               engine_transport=rec)


def test_the_right_matcher_keeps_every_sampled_turn(agent_dir, engine) -> None:
    rec = RecordingTransport()
    with _server(agent_dir, engine, "omit_reasoning", "reject", rec) as srv:
        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        client = openai.OpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key="unused")
        raws = _converse(client)
        first = raws[0].parse().choices[0]
        assert first.finish_reason == "tool_calls"  # the conversation does exercise the replay
        assert getattr(first.message, "reasoning_content", None)
        assert all(HEADER.lower() not in {k.lower() for k in r.headers} for r in raws)
        (sample,) = httpx.post(f"{srv.url}/sessions/{sid}/samples").json()["samples"]
    calls = [(req, out) for req, out, h in rec.generate_calls]
    assert len(calls) == 4 and sample["metadata"]["turns"] == 4
    for (req, out), (nxt, _) in zip(calls, calls[1:]):  # each prompt extends the last, exactly
        seen = req["input_ids"] + out["output_ids"]
        assert nxt["input_ids"][:len(seen)] == seen
    assert sample["tokens"] == calls[-1][0]["input_ids"] + calls[-1][1]["output_ids"]
    n_prompt = len(sample["tokens"]) - sample["response_length"]
    sampled = [t for t, m in zip(sample["tokens"][n_prompt:], sample["loss_mask"]) if m]
    assert sampled == [t for _, out in calls for t in out["output_ids"]]
    assert sample["metadata"]["session_rollbacks"] == 0
    assert sample["metadata"]["session_retokenized_tokens"] == 0


def test_strict_rejects_with_the_message_and_field(agent_dir, engine) -> None:
    with _server(agent_dir, engine, "strict", "reject") as srv:
        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        client = openai.OpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key="unused",
                               max_retries=0)
        with pytest.raises(openai.ConflictError) as e:
            _converse(client, turns=2)
        text = str(e.value)
        assert "at message 1 (assistant)" in text and "reasoning_content" in text
        assert "omit_reasoning" in text  # names the matcher that accepts this replay
        assert e.value.response.headers[HEADER].startswith("rejected; message=1")
        record = e.value.response.json()["error"]["divergence"]
        assert record["kind"] == "rejected" and record["suggestion"] == "omit_reasoning"
        summary = httpx.get(f"{srv.url}/sessions/{sid}").json()
        assert len(summary["turns"]) == 1  # the stored turn stays; nothing replaced it
        assert [d["kind"] for d in summary["divergences"]] == ["rejected"]


def test_strict_rollback_is_recorded(agent_dir, engine) -> None:
    rec = RecordingTransport()
    with _server(agent_dir, engine, "strict", "rollback", rec) as srv:
        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        client = openai.OpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key="unused")
        raws = _converse(client)
        flagged = [r for r in raws if r.headers.get(HEADER)]
        # Turn 2 replays turn 1 (reasoning + a tool call) without its reasoning: a rollback.
        assert raws[1].headers.get(HEADER, "").startswith("rollback; message=1; field=reasoning")
        body = json.loads(raws[1].content)
        assert body["milepost"]["divergence"]["kind"] == "rollback"
        assert body["milepost"]["divergence"]["retokenized_tokens"] == len(
            rec.generate_calls[0][1]["output_ids"])
        (sample,) = httpx.post(f"{srv.url}/sessions/{sid}/samples").json()["samples"]
    # Each rollback is counted, and the tokens it turned into context are not trained.
    assert sample["metadata"]["session_rollbacks"] == len(flagged)
    assert sample["metadata"]["session_retokenized_tokens"] > 0
    sampled_everywhere = sum(len(out["output_ids"]) for _, out, _ in rec.generate_calls)
    assert sum(sample["loss_mask"]) < sampled_everywhere


def test_published_qwen3_template_live(agent_dir, engine) -> None:
    """The published Qwen3 template, unmodified, on the tiny model's vocabulary (its layout is the
    one the model learned): turn 3 makes the template drop turns 1-2's reasoning and their
    replays omit it; `strict` accepts that (the template does not read it there), the suffix
    comes from the template's text after the stored turns, and every turn extends the last."""
    from transformers import AutoTokenizer

    from milepost.testing.chat_templates import QWEN3

    tok = AutoTokenizer.from_pretrained(agent_dir)
    tok.chat_template = QWEN3
    rec = RecordingTransport()
    settings = SessionSettings(mode="linear")
    with SessionServerThread(tok, engine.url, family="qwen3", matcher="strict", settings=settings,
                             engine_transport=rec) as srv, \
            httpx.Client(base_url=srv.url, timeout=300) as c:
        sid = c.post("/sessions").json()["session_id"]
        url = f"/sessions/{sid}/v1/chat/completions"
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        sampling = {"temperature": 0, "max_tokens": 96}
        first = c.post(url, json={"messages": messages, **sampling}).json()["choices"][0]
        assert first["finish_reason"] == "tool_calls" and first["message"]["reasoning_content"]
        call = first["message"]["tool_calls"][0]
        messages += [first["message"], {"role": "tool", "tool_call_id": call["id"],
                                        "content": "snow"}]
        second = c.post(url, json={"messages": messages, **sampling}).json()["choices"][0]
        messages.append(second["message"])
        # The harness now forgets every reasoning it was sent, and asks something new.
        messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
        r = c.post(url, json={"messages": messages + [{"role": "user", "content": "Thanks!"}],
                              **sampling})
        assert r.status_code == 200, r.text
        assert r.json()["milepost"]["divergence"] is None
        (sample,) = c.post(f"/sessions/{sid}/samples").json()["samples"]
    calls = [(req, out) for req, out, h in rec.generate_calls]
    assert len(calls) == 3 and sample["metadata"]["turns"] == 3
    for (req, out), (nxt, _) in zip(calls, calls[1:]):
        seen = req["input_ids"] + out["output_ids"]
        assert nxt["input_ids"][:len(seen)] == seen
    # The template's own rendering drops turn 1's reasoning; the prompt the engine saw kept it.
    reasoning = first["message"]["reasoning_content"]
    with_reasoning = [messages[0], first["message"], *messages[2:],
                      {"role": "user", "content": "Thanks!"}]
    assert reasoning not in tok.apply_chat_template(with_reasoning, tokenize=False)
    assert reasoning in tok.decode(calls[2][0]["input_ids"])
    n_prompt = len(sample["tokens"]) - sample["response_length"]
    sampled = [t for t, m in zip(sample["tokens"][n_prompt:], sample["loss_mask"]) if m]
    assert sampled == [t for _, out in calls for t in out["output_ids"]]
