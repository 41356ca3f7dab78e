"""The sandboxed terminal environment as an agent fn (report 2.3, section 9's setting in small):
each episode gets a fresh bubblewrap sandbox with the task's files, the model calls a `shell`
tool through the session server, the task's own test script grades the final workspace (reward
1 on exit 0, else 0), and the sandbox is deleted. An episode ends after `MAX_TURNS` model calls
or `EPISODE_TIMEOUT_S` seconds, whichever comes first.

    --agent-function-path milepost.envs.terminal:terminal_agent_fn
    --reward-fn milepost.rollout.layers:agent_reward

`terminal_agent_fn_unsafe_no_sandbox` is the explicit switch for machines without user
namespaces: the same episode with commands run unisolated in a temp directory.
"""

from __future__ import annotations

import asyncio
import json
import time

from milepost.envs.sandbox import Sandbox
from milepost.envs.tasks import TASKS_BY_NAME
from milepost.rollout.layers import AgentContext, AgentOutcome

MAX_TURNS = 8
EPISODE_TIMEOUT_S = 300.0
SYSTEM = ("You work in a Linux shell in the directory /workspace. Run commands with the shell "
          "tool, one command per call. When the task is done, answer without a tool call. To "
          'run a command, reply with only: <tool_call>{"name": "shell", "arguments": '
          '{"command": "ls"}}</tool_call> (with your command instead of ls).')
# A demonstration before the task (prompt context, never trained on). Templates without a tool
# section (SmolLM2's) never show the model the call format otherwise: with the instruction alone,
# SmolLM2-135M wrote 0 parseable calls in 48 first turns; with this exchange, 21 (T=0.7).
DEMO = [{"role": "user", "content": "List the files."},
        {"role": "assistant",
         "content": '<tool_call>{"name": "shell", "arguments": {"command": "ls"}}</tool_call>'},
        {"role": "user", "content": "Good."}]
SHELL_TOOL = {"type": "function", "function": {
    "name": "shell", "description": "Run a /bin/sh command in /workspace; returns its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}


async def run_episode(ctx: AgentContext, *, allow_unsafe_no_sandbox: bool = False,
                      max_turns: int = MAX_TURNS, timeout_s: float = EPISODE_TIMEOUT_S,
                      ) -> AgentOutcome:
    task_name = str(ctx.item.label)
    if task_name not in TASKS_BY_NAME:
        raise ValueError(f"terminal environment: label {task_name!r} names no task; known: "
                         f"{sorted(TASKS_BY_NAME)}")
    task = TASKS_BY_NAME[task_name]
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


async def terminal_agent_fn(ctx: AgentContext) -> AgentOutcome:
    return await run_episode(ctx)


async def terminal_agent_fn_unsafe_no_sandbox(ctx: AgentContext) -> AgentOutcome:
    """NO ISOLATION: model commands run as plain subprocesses in a temp directory."""
    return await run_episode(ctx, allow_unsafe_no_sandbox=True)
