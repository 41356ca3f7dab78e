"""Solve rate of a checkpoint on a tier of the terminal tasks (milepost/envs/tasks.py), through a
real `milepost serve`, the session server and the bubblewrap sandbox: the episodes a training run
would play (terminal.run_episode), without training. Used for the easy tier's numbers before and
after GRPO (docs/concepts/agentic.md).

    python benchmarks/terminal_solve_rate.py MODEL_DIR --tier easy_heldout --episodes 4 \\
        --temperature 0.7 --max-new 64 --max-turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from contextvars import ContextVar
from pathlib import Path

import httpx


_COMMANDS: ContextVar[list[str]] = ContextVar("commands")


def _record_commands() -> None:
    """Keep each episode's commands (the model's, then the grading test) for the JSON output:
    asyncio.to_thread copies the episode's context, so the list reaches the sandbox's thread."""
    import milepost.envs.terminal as terminal

    class Recording(terminal.Sandbox):
        def run(self, command: str):  # type: ignore[no-untyped-def]
            _COMMANDS.get().append(command)
            return super().run(command)

    terminal.Sandbox = Recording  # type: ignore[misc]


async def _play(url: str, tasks: list, episodes: int, max_new: int, max_turns: int,
                parallel: int, unsafe: bool) -> list[dict]:
    from milepost.data.source import PromptItem
    from milepost.envs.terminal import DEMO, run_episode
    from milepost.rollout.layers import AgentContext

    gate = asyncio.Semaphore(parallel)
    shown_calls = sum(m["role"] == "assistant" for m in DEMO)  # the demonstrations' replies

    async def one(http: httpx.AsyncClient, task, k: int) -> dict:
        async with gate:
            commands: list[str] = []
            _COMMANDS.set(commands)
            sid = (await http.post(f"{url}/sessions")).json()["session_id"]
            item = PromptItem(index=0, prompt="", prompt_ids=[], label=task.name)
            ctx = AgentContext(f"{url}/sessions/{sid}/v1", item, k, http, max_new)
            out = await run_episode(ctx, max_turns=max_turns, timeout_s=600,
                                    allow_unsafe_no_sandbox=unsafe)
            shown = (await http.get(f"{url}/sessions/{sid}")).json()
            await http.delete(f"{url}/sessions/{sid}")
            replies = [m.get("content") or json.dumps(m.get("tool_calls"))
                       for m in shown["messages"] if m["role"] == "assistant"]
            return {"task": task.name, "reward": out.reward, **out.metadata,
                    "ran": commands[:-1],  # the last one is the task's test
                    "first_reply": replies[shown_calls] if len(replies) > shown_calls else None}

    async with httpx.AsyncClient(timeout=900) as http:
        return await asyncio.gather(*(one(http, t, k) for t in tasks for k in range(episodes)))


def main() -> int:
    from milepost.envs.tasks import TIERS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--tier", default="easy_heldout", choices=sorted(TIERS))
    p.add_argument("--episodes", type=int, default=4, help="episodes per task")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new", type=int, default=64, help="tokens per model call")
    p.add_argument("--max-turns", type=int, default=3, help="model calls per episode")
    p.add_argument("--parallel", type=int, default=16, help="episodes at once")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--allow-unsafe-no-sandbox", action="store_true",
                   help="where bubblewrap cannot isolate (the summary's `sandboxed` says so): "
                        "run the model's commands unisolated, as terminal_agent_fn_unsafe_no_sandbox")
    a = p.parse_args()

    from milepost.session.runner import SessionServerThread
    from milepost.session.service import SessionSettings
    from milepost.testing.server_process import ServerProcess

    _record_commands()
    tasks = list(TIERS[a.tier])
    t0 = time.perf_counter()
    settings = SessionSettings(sampling={"max_new_tokens": a.max_new,
                                         "temperature": a.temperature})
    with ServerProcess(a.model, "--device", a.device, "--max-total-tokens", "32768",
                       timeout_s=600) as engine, \
            SessionServerThread(a.model, engine.url, family="chatml", settings=settings) as srv:
        rows = asyncio.run(_play(srv.url, tasks, a.episodes, a.max_new, a.max_turns, a.parallel,
                                a.allow_unsafe_no_sandbox))
    solved = sum(r["reward"] for r in rows)
    kinds: Counter[str] = Counter()
    kinds_solved: Counter[str] = Counter()
    for r in rows:
        kind = r["task"].split("_")[1] if r["task"].startswith("easy_") else r["task"]
        kinds[kind] += 1
        kinds_solved[kind] += int(r["reward"])
    summary = {
        "model": str(a.model), "tier": a.tier, "temperature": a.temperature,
        "episodes": len(rows), "solved": int(solved), "solve_rate": solved / len(rows),
        "commands": sum(r["commands"] for r in rows),
        "by_kind": {k: f"{kinds_solved[k]}/{kinds[k]}" for k in sorted(kinds)},
        "sandboxed": all(r["sandboxed"] for r in rows),
        "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))
    if a.json_out:
        a.json_out.write_text(json.dumps({"summary": summary, "episodes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
