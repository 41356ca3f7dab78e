"""The sandboxed terminal environment as an agent fn (report 2.3, section 9's setting in small):
each episode gets a fresh bubblewrap sandbox with the task's files, the model calls a `shell`
tool through the session server, the task's own test script grades the final workspace (reward
1 on exit 0, else 0), and the sandbox is deleted. An episode ends after `MAX_TURNS` model calls
or `EPISODE_TIMEOUT_S` seconds, whichever comes first.

    --agent-function-path milepost.envs.terminal:terminal_agent_fn
    --custom-generate-function-path milepost.connectors.episodes:env_generate
    --reward-fn milepost.connectors.episodes:env_reward

An episode that raises (a session call failing, the sandbox breaking) or passes its time limit
fails with the reason, as an outside environment's does (milepost/connectors/episodes.py): its
group is reported and not trained on, and the run goes on. A machine without isolation and a
label that names no task still stop the run: every episode would fail the same way.

`terminal_agent_fn_unsafe_no_sandbox` is the explicit switch for machines without user
namespaces: the same episode with commands run unisolated in a temp directory.
"""

from __future__ import annotations

import asyncio
import json
import time

from milepost.connectors import episodes
from milepost.envs.sandbox import Sandbox, SandboxUnavailable
from milepost.envs.tasks import TASKS_BY_NAME, TerminalTask
from milepost.rollout.layers import AgentContext, AgentOutcome

MAX_TURNS = 8
EPISODE_TIMEOUT_S = 300.0
SYSTEM = ("You work in a Linux shell in the directory /workspace. Run commands with the shell "
          "tool, one command per call. When the task is done, answer without a tool call. To "
          'run a command, reply with only: <tool_call>{"name": "shell", "arguments": '
          '{"command": "ls"}}</tool_call> (with your command instead of ls).')
# Demonstrations before the task (prompt context, never trained on). Templates without a tool
# section (SmolLM2's) never show the model the call format otherwise: with the instruction alone,
# SmolLM2-135M wrote 0 parseable calls in 48 first turns; with the `ls` exchange alone, 21 (T=0.7),
# but its calls then mostly carried a bare program name. With commands that take a file name
# (none of them a task's goal), its held-out easy-tier solve rate went from 2 to 22 of 72
# episodes (T=0.7, 3 calls of 48 tokens; docs/concepts/agentic.md).
def _shown(request: str, command: str) -> list[dict[str, str]]:
    call = json.dumps({"name": "shell", "arguments": {"command": command}})
    return [{"role": "user", "content": request},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "user", "content": "Good."}]


DEMO = [*_shown("List the files.", "ls"), *_shown("Show the file readme.txt.", "cat readme.txt"),
        *_shown("Show the lines of readme.txt that contain ok.", "grep ok readme.txt")]
SHELL_TOOL = {"type": "function", "function": {
    "name": "shell", "description": "Run a /bin/sh command in /workspace; returns its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}


def task_of(label: object) -> TerminalTask:
    """The task a prompt's label names; a ValueError naming the known ones."""
    if str(label) not in TASKS_BY_NAME:
        raise ValueError(f"terminal environment: label {label!r} names no task; known: "
                         f"{sorted(TASKS_BY_NAME)}")
    return TASKS_BY_NAME[str(label)]


async def run_episode(ctx: AgentContext, *, allow_unsafe_no_sandbox: bool = False,
                      max_turns: int = MAX_TURNS, timeout_s: float = EPISODE_TIMEOUT_S,
                      ) -> AgentOutcome:
    task = task_of(ctx.item.label)
    box = await asyncio.to_thread(Sandbox, task.files,
                                  allow_unsafe_no_sandbox=allow_unsafe_no_sandbox)
    messages = [{"role": "system", "content": SYSTEM}, *DEMO,
                {"role": "user", "content": task.instruction}]
    deadline = time.monotonic() + timeout_s
    turns = commands = 0
    ended = "max_turns"
    try:
        while turns < max_turns:
            if time.monotonic() > deadline:
                ended = "timeout"
                break
            resp = await ctx.http.post(f"{ctx.base_url}/chat/completions", json={
                "messages": messages, "tools": [SHELL_TOOL], "max_tokens": ctx.max_new_tokens},
                timeout=max(1.0, deadline - time.monotonic()))
            turns += 1
            if resp.status_code >= 400:
                ended = f"session error {resp.status_code}"
                break
            choice = resp.json()["choices"][0]
            msg = choice["message"]
            messages.append(msg)
            if choice["finish_reason"] != "tool_calls":
                ended = choice["finish_reason"]
                break
            for call in msg["tool_calls"]:
                try:
                    command = json.loads(call["function"]["arguments"])["command"]
                    result = await asyncio.to_thread(box.run, str(command))
                    output = f"exit code {result.exit_code}\n{result.output}"
                    commands += 1
                except (json.JSONDecodeError, KeyError, TypeError):
                    output = 'error: call shell with {"command": "..."}'
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        grade = await asyncio.to_thread(box.run, task.test)
    finally:
        await asyncio.to_thread(box.close)
    return AgentOutcome(reward=float(grade.exit_code == 0), metadata={
        "task": task.name, "agent_turns": turns, "commands": commands, "ended": ended,
        "sandboxed": box.isolated})


async def guarded_episode(ctx: AgentContext, *, allow_unsafe_no_sandbox: bool = False,
                          ) -> AgentOutcome:
    """`run_episode`, with any failure but a refusal turned into a failed episode carrying
    `metadata["env_error"]` (grade with `episodes:env_reward`, which keeps its group out)."""
    task_of(ctx.item.label)  # a label that names no task stops the run
    limit = EPISODE_TIMEOUT_S + 60  # run_episode checks its deadline between calls; this bounds one
    try:
        return await asyncio.wait_for(
            run_episode(ctx, allow_unsafe_no_sandbox=allow_unsafe_no_sandbox), timeout=limit)
    except SandboxUnavailable:
        raise
    except asyncio.TimeoutError:
        return episodes.failed(f"terminal task {ctx.item.label}: no result within {limit:g} s")
    except Exception as e:  # noqa: BLE001 - the episode fails with the reason; the run goes on
        return episodes.failed(f"terminal task {ctx.item.label}: {type(e).__name__}: {e}")


async def terminal_agent_fn(ctx: AgentContext) -> AgentOutcome:
    return await guarded_episode(ctx)


async def terminal_agent_fn_unsafe_no_sandbox(ctx: AgentContext) -> AgentOutcome:
    """NO ISOLATION: model commands run as plain subprocesses in a temp directory."""
    return await guarded_episode(ctx, allow_unsafe_no_sandbox=True)
