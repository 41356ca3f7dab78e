"""Fuzzing the session server's endpoints (hypothesis, bounded) against a real engine: no 5xx,
both servers (linear and branching) stay alive, no turn is left pending, the engine's KV returns
to where it started, and a good turn is still answered exactly as before."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from milepost.session.runner import SessionServerThread
from milepost.session.service import SessionSettings
from milepost.testing.server_process import ServerProcess

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

GOOD = {"messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "max_tokens": 12, "temperature": 0}

# JSON values of every kind, including awkward ones (huge ints, extreme floats, unicode,
# nesting); lone surrogates and non-finite numbers come as raw bodies below.
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)

def _or_wild(plausible: st.SearchStrategy, odds: int = 3) -> st.SearchStrategy:
    """Mostly (`odds` to 1) a value of the right shape, sometimes anything."""
    return st.one_of(*[plausible] * odds, values)


texts = st.text(max_size=16)
unit = st.floats(0, 1, allow_nan=False)
tools = st.lists(st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": texts, "parameters": values},
                                       optional={"description": values})}), max_size=2)
# OpenAI chat fields, mostly in range, and a few a client may add that the server ignores.
FIELDS = {
    "model": texts, "tools": tools, "temperature": st.floats(0, 2), "top_p": unit,
    "top_k": st.integers(-2, 20), "min_p": unit, "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0, 2),
    "stop": texts | st.lists(texts, max_size=3), "n": st.integers(0, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": st.integers(-(2**70), 2**70), "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 2), "tool_choice": st.sampled_from(["auto", "none"]),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x", "tools"]),
                                            values, max_size=2),
    "max_completion_tokens": st.integers(-1, 6), "prompt_token_ids": st.lists(st.integers(-5, 10**6)),
    "user": texts, "metadata": values,
}
MESSAGE_KEYS = ["role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name"]
content = texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                           max_size=2)


@st.composite
def history(draw: st.DrawFn) -> list[dict]:
    """A well-formed conversation that ends on the user's (or a tool's) message."""
    msgs = [{"role": "system", "content": draw(texts)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(0, 2))):
        msgs.append({"role": "user", "content": draw(content)})
        if draw(st.booleans()):
            args = draw(texts | st.dictionaries(texts, scalars, max_size=2))
            msgs.append({"role": "assistant", "content": draw(st.none() | texts), "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": draw(texts) or "f",
                                                              "arguments": args}}]})
            msgs.append({"role": "tool", "tool_call_id": "c1", "content": draw(texts)})
        else:
            msgs.append({"role": "assistant", "content": draw(texts),
                         "reasoning_content": draw(st.none() | texts)})
    msgs.append({"role": "user", "content": draw(content)})
    return msgs


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict:
    """A plausible request, then up to two wild edits: a field of the body or of one message set
    to any JSON value, or removed."""
    msgs = draw(history())
    body: dict = {"messages": msgs, "max_tokens": draw(st.integers(1, 6))}
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True)):
        body[key] = draw(FIELDS[key])
    for _ in range(draw(st.integers(0, 2))):
        target = body if draw(st.booleans()) else draw(st.sampled_from(msgs))
        key = draw(st.sampled_from(["messages", "max_tokens", *sorted(FIELDS)]
                                   if target is body else MESSAGE_KEYS))
        if draw(st.integers(0, 4)):
            target[key] = draw(values)
        else:
            target.pop(key, None)
    # keep accepted turns short: a fuzzed length must not make the run slow
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 6:
            body[key] = 6
    return body


# (server index, method, path template, body); "{sid}" is one of the server's live sessions.
ids = _or_wild(st.just("{sid}"), 5).map(
    lambda v: v if v == "{sid}" else quote(str(v), safe="", errors="surrogatepass"))
chat_turns = st.tuples(st.integers(0, 1), st.just("POST"),
                       ids.map("/sessions/{}/v1/chat/completions".format), _or_wild(chat_bodies(), 5))
others = st.one_of(
    st.tuples(st.integers(0, 1), st.just("POST"), ids.map("/sessions/{}/samples".format),
              st.none() | st.fixed_dictionaries({"leaves": _or_wild(st.lists(st.integers(-2, 8)))})
              | values),
    st.tuples(st.integers(0, 1), st.sampled_from(["GET", "DELETE"]), ids.map("/sessions/{}".format),
              st.none()),
    st.tuples(st.integers(0, 1), st.just("POST"), st.just("/sessions"), st.none() | values),
)
RAW = [b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
       b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
       b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
       b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\udfff"}',
       b"\xff\xfe", b"{" * 1000, b"[]", b"null"]


def _used_tokens(engine: ServerProcess) -> int:
    return httpx.get(f"{engine.url}/v1/loads", timeout=10).json()["loads"][0]["num_used_tokens"]


def test_fuzzed_session_requests_never_5xx(agent_dir: Path, agent_engine: ServerProcess) -> None:
    engine = agent_engine
    settings = [SessionSettings(mode=m, sampling={"max_new_tokens": 6})
                for m in ("linear", "branching")]
    with SessionServerThread(agent_dir, engine.url, family="qwen3", settings=settings[0]) as lin, \
            SessionServerThread(agent_dir, engine.url, family="qwen3",
                                settings=settings[1]) as br:
        clients = [httpx.Client(base_url=s.url, timeout=120) for s in (lin, br)]
        sids = [c.post("/sessions").json()["session_id"] for c in clients]
        reference = [clients[i].post(f"/sessions/{sids[i]}/v1/chat/completions", json=GOOD).json()
                     ["choices"][0]["message"] for i in (0, 1)]
        start = _used_tokens(engine)
        seen: list[tuple[str, int]] = []  # (the path's last part, status)

        def send(req: tuple[int, str, str, object]) -> None:
            i, method, path, body = req
            if path.endswith("/completions") and i == 0 and len(seen) % 2:
                # every other linear turn in a fresh session: else nearly all are divergences
                sids[0] = clients[0].post("/sessions").json()["session_id"]
            path = path.replace("{sid}", sids[i])
            r = clients[i].request(method, path, **({} if body is None else {"json": body}))
            seen.append((path.rsplit("/", 1)[-1], r.status_code))
            assert r.status_code < 500, f"{method} {path} {body!r} -> {r.status_code}: {r.text[:300]}"
            if method == "DELETE" and r.status_code == 200 and path.endswith(sids[i]):
                sids[i] = clients[i].post("/sessions").json()["session_id"]  # keep one live

        for strategy, n in ((chat_turns, 200), (others, 100)):
            hypothesis.settings(max_examples=n, deadline=None, derandomize=True,
                                suppress_health_check=list(hypothesis.HealthCheck))(
                hypothesis.given(strategy)(send))()
        for c, sid in zip(clients, sids):
            for raw in RAW:
                r = c.post(f"/sessions/{sid}/v1/chat/completions", content=raw,
                           headers={"content-type": "application/json"})
                assert 400 <= r.status_code < 500, (raw[:40], r.status_code, r.text[:200])
        # the fuzz reached the engine often, and was refused often (else it tested little)
        turns = [s for p, s in seen if p == "completions"]
        assert turns.count(200) >= 20 and sum(400 <= s < 500 for s in turns) >= 20, turns
        for c, sid in zip(clients, sids):
            assert c.get("/health").status_code == 200
            assert c.get(f"/sessions/{sid}").json()["pending_turns"] == 0
        deadline = time.monotonic() + 60
        while _used_tokens(engine) != start:
            assert time.monotonic() < deadline, "the engine's KV did not return to its start value"
            time.sleep(0.2)
        for i, c in enumerate(clients):  # a fresh session: the same answer as before the fuzz
            sid = c.post("/sessions").json()["session_id"]
            r = c.post(f"/sessions/{sid}/v1/chat/completions", json=GOOD)
            assert r.status_code == 200 and r.json()["choices"][0]["message"] == reference[i]
            c.close()
