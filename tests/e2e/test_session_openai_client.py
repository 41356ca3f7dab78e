"""The official `openai` Python client as the harness (skipped when it is not installed): tool
calls, reasoning and streaming through the session server, with the tiny tool-calling model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.session.runner import SessionServerThread
from milepost.testing.agent_model import make_agent_model
from milepost.testing.server_process import ServerProcess

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_agent_model(tmp_path_factory.getbasetemp() / "agent_model_shared")


def test_openai_client_runs_a_tool_loop(agent_dir) -> None:
    with ServerProcess(agent_dir, "--max-total-tokens", "8192") as engine, \
            SessionServerThread(agent_dir, engine.url, family="qwen3") as srv:
        import httpx

        sid = httpx.post(f"{srv.url}/sessions").json()["session_id"]
        client = openai.OpenAI(base_url=f"{srv.url}/sessions/{sid}/v1", api_key="unused")
        messages: list[dict] = [{"role": "user", "content": "Weather in Lima?"}]
        # No tool list: the tiny model learned its one tool without one in the prompt.
        first = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                               max_tokens=96)
        call = first.choices[0].message.tool_calls[0]
        assert first.choices[0].finish_reason == "tool_calls"
        assert "city" in json.loads(call.function.arguments)
        # The client's own serialization of its message is what goes back (extra None fields).
        messages += [first.choices[0].message.model_dump(exclude_none=False),
                     {"role": "tool", "tool_call_id": call.id, "content": "mild"}]
        stream = client.chat.completions.create(model="m", messages=messages, temperature=0,
                                                max_tokens=96, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text
        summary = httpx.get(f"{srv.url}/sessions/{sid}").json()
        assert len(summary["turns"]) == 2 and summary["leaves"] == [2]  # one lineage, extended
