"""Routed experts across turns (report 2.5 with 2.4): a session on a tiny MoE engine yields one
training sequence whose routed-expert rows are, for every token, the rows of the engine call that
first processed it."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from milepost.session.runner import SessionServerThread
from milepost.session.service import SessionSettings
from milepost.testing.agent_harness import RecordingTransport
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess


def _rows(b64: str, n_rows: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(b64), dtype=np.int32)
    return flat.reshape(n_rows, -1)


@pytest.mark.parametrize("stream", [False, True])
def test_routed_experts_survive_the_turns(tmp_path, stream: bool) -> None:
    model = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe")
    sampling = {"max_new_tokens": 32, "stop_token_ids": list(range(7, 512, 4))}
    rec = RecordingTransport()
    with ServerProcess(model, "--max-total-tokens", "8192") as engine, SessionServerThread(
            model, engine.url, family="qwen3", engine_transport=rec,
            settings=SessionSettings(sampling=sampling, return_routed_experts=True)) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        sid = c.post("/sessions").json()["session_id"]
        messages = [{"role": "user", "content": "first question"}]
        for t in range(3):
            r = c.post(f"/sessions/{sid}/v1/chat/completions",
                       json={"messages": messages, "stream": stream})
            assert r.status_code == 200, r.text
            # streamed: the reply as stored (the deltas add up to it, test_session_stream.py)
            reply = (c.get(f"/sessions/{sid}").json()["messages"][-1] if stream
                     else r.json()["choices"][0]["message"])
            messages += [reply, {"role": "user", "content": f"q{t}"}]
        (sample,) = c.post(f"/sessions/{sid}/samples").json()["samples"]
    tokens = sample["tokens"]
    stitched = _rows(sample["routed_experts"], len(tokens) - 1)
    start = 0
    assert all(bool(req.get("stream")) == stream for req, _, _ in rec.generate_calls)
    for req, out, _ in rec.generate_calls:
        seq = req["input_ids"] + out["output_ids"]
        assert tokens[:len(seq)] == seq
        call_rows = _rows(out["meta_info"]["routed_experts"], len(seq) - 1)
        end = len(seq) - 1
        assert (stitched[start:end] == call_rows[start:end]).all()
        start = end
    assert start == len(tokens) - 1
    assert stitched.shape[1] == 2 * 2  # layers x top_k of the tiny MoE
