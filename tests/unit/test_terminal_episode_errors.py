"""A terminal episode that breaks fails with the reason and its group is not trained on, as an
outside environment's does (issue 25, bad input); a machine without isolation and a label that
names no task still stop the run. The session server is an httpx mock transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import milepost.envs.sandbox as sb
import milepost.envs.terminal as terminal
from milepost.connectors.episodes import ERROR_KEY, env_reward
from milepost.data.source import PromptItem
from milepost.envs.sandbox import SandboxUnavailable
from milepost.rollout.layers import AgentContext
from milepost.types import Sample

CALL = {"id": "c1", "type": "function",
        "function": {"name": "shell", "arguments": json.dumps({"command": "touch notes.txt"})}}


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands unisolated in the sandbox's temp dir: the commands here are the test's own."""
    monkeypatch.setattr(sb, "isolation_problem", lambda: "episode errors only")


def _play(handler, label: str = "easy_touch_notes.txt", unsafe: bool = True):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            item = PromptItem(index=0, prompt="", prompt_ids=[], label=label)
            ctx = AgentContext("http://session/v1", item, 0, http, 48)
            fn = (terminal.terminal_agent_fn_unsafe_no_sandbox if unsafe
                  else terminal.terminal_agent_fn)
            return await fn(ctx)
    return asyncio.run(go())


def _reply(calls: int):
    """A session server whose model calls the shell once, then answers; call `calls` + 1 breaks."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if len(seen) > calls:
            raise httpx.ReadError("connection reset by the loaded session server")
        if len(seen) == 1:
            msg = {"role": "assistant", "content": None, "tool_calls": [CALL]}
            return httpx.Response(200, json={"choices": [{"message": msg,
                                                          "finish_reason": "tool_calls"}]})
        return httpx.Response(200, json={"choices": [{
            "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}]})
    return handler


def test_a_whole_episode_is_graded(plain: None) -> None:
    out = _play(_reply(calls=2))
    assert out.reward == 1.0 and ERROR_KEY not in out.metadata
    assert out.metadata["commands"] == 1 and out.metadata["ended"] == "stop"


def test_a_failing_session_call_fails_the_episode_with_its_reason(plain: None) -> None:
    out = _play(_reply(calls=1))  # the second model call raises httpx.ReadError
    assert "ReadError" in out.metadata[ERROR_KEY]
    assert "easy_touch_notes.txt" in out.metadata[ERROR_KEY]
    sample = Sample(group_index=0, index=0, tokens=[1], response_length=1,
                    metadata={**out.metadata, "agent_reward": out.reward})
    with pytest.raises(RuntimeError, match="ReadError"):  # its group: a reward error, dropped
        env_reward(sample)


def test_an_episode_past_its_limit_fails(plain: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(terminal, "EPISODE_TIMEOUT_S", -59.8)  # the backstop: 0.2 s

    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)  # a model call that never answers
        return httpx.Response(200, json={})

    out = _play(hang)
    assert "no result within" in out.metadata[ERROR_KEY]


def test_no_isolation_and_an_unknown_task_stop_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sb, "isolation_problem", lambda: "user namespaces are forbidden")
    with pytest.raises(SandboxUnavailable):
        _play(_reply(calls=2), unsafe=False)
    with pytest.raises(ValueError, match="names no task"):
        _play(_reply(calls=2), label="no_such_task")
