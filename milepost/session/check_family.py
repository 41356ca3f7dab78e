"""`milepost check-family --model DIR --family NAME`: the two checks of a family registration
(report 2.4.3) on a user's own checkpoint, to find hidden drift before a run does.

- CPU: the append-only battery on the checkpoint's tokenizer and template (checks.py), printing
  the first differing token with its neighbours;
- live (`--serve`, or `--engine-url` of a running engine serving this checkpoint): a few real
  turns through the session server; each engine call's prompt must extend the previous call's
  prompt + output token for token, the trained ids must be the engine's, the model's stop must
  be the family's end-of-turn token, and tool-call markers must parse.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any

from milepost.session.checks import CheckResult, check_append_only

USER_TURNS = ("Say hello in one short sentence.", "Now say goodbye.", "Thanks, one more word?")


def cpu_check(model: str | Path, family: str) -> list[CheckResult]:
    from milepost.session.runner import make_renderer_unchecked

    return check_append_only(make_renderer_unchecked(model, family))


def live_check(model: str | Path, family: str, engine_url: str, turns: int = 3,
               max_tokens: int = 64, prompts: tuple[str, ...] = USER_TURNS,
               ) -> list[CheckResult]:
    """Real turns through a session server against `engine_url`: the next user prompt after a
    plain answer, a tool result ("ok") for each call after a tool-calling turn."""
    import httpx

    from milepost.session.runner import SessionServerThread
    from milepost.testing.agent_harness import RecordingTransport

    rec = RecordingTransport()
    out: list[CheckResult] = []
    with SessionServerThread(model, engine_url, family=family, engine_transport=rec) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as c:
        eots = srv.renderer.eot_ids
        sid = c.post("/sessions").json()["session_id"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompts[0]}]
        asked = 1
        parsed_calls = 0
        for k in range(turns):
            r = c.post(f"/sessions/{sid}/v1/chat/completions", json={
                "messages": messages, "temperature": 0, "max_tokens": max_tokens})
            if r.status_code != 200:
                out.append(CheckResult(f"turn {k + 1}", False, f"HTTP {r.status_code}: {r.text}"))
                return out
            choice = r.json()["choices"][0]
            if choice["finish_reason"] == "length":
                out.append(CheckResult(f"turn {k + 1} stop", False, f"the model did not stop in "
                                       f"{max_tokens} tokens (raise --max-tokens); later turns "
                                       f"cannot extend a truncated turn"))
                break
            messages.append(choice["message"])
            parsed_calls += len(choice["message"].get("tool_calls") or [])
            for call in choice["message"].get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
            if not choice["message"].get("tool_calls"):
                messages.append({"role": "user", "content": prompts[asked % len(prompts)]})
                asked += 1
        (sample,) = c.post(f"/sessions/{sid}/samples").json()["samples"]
        unparsed = sample["metadata"].get("session_unparsed_tool_calls", 0)
    calls = [(req["input_ids"], ans["output_ids"], ans["meta_info"]["finish_reason"])
             for req, ans, _ in rec.generate_calls]
    for k, ((ids, outs, _), (nxt, _, _)) in enumerate(itertools.pairwise(calls)):
        seen = ids + outs
        ok = nxt[:len(seen)] == seen
        at = next((i for i, (a, b) in enumerate(zip(nxt, seen)) if a != b), len(seen))
        out.append(CheckResult(f"turn {k + 2} extends turn {k + 1}", ok,
                               "" if ok else f"prompt id {at} differs from what the engine saw"))
    for k, (_, outs, fin) in enumerate(calls):
        if fin.get("type") == "stop":
            ok = bool(outs) and outs[-1] in eots
            out.append(CheckResult(f"turn {k + 1} stop token", ok, "" if ok else
                                   f"stopped on {fin.get('matched')!r}, not the family's "
                                   f"end-of-turn ids {sorted(eots)}"))
    n_prompt = len(sample["tokens"]) - sample["response_length"]
    sampled = [t for t, m in zip(sample["tokens"][n_prompt:], sample["loss_mask"]) if m]
    engine_ids = [t for _, outs, _ in calls for t in outs]
    out.append(CheckResult("trained ids are the engine's", sampled == engine_ids))
    out.append(CheckResult("tool-call output parses", unparsed == 0,
                           f"{parsed_calls} calls parsed, {unparsed} tool-call blocks kept as "
                           f"text"))
    return out


def add_check_family_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-family", help="check a model family (chat template + parsers) on a checkpoint",
        description="Run the session server's family checks on a checkpoint: the CPU "
        "append-only battery, and with --serve or --engine-url a live multi-turn check against a "
        "real engine (docs/sessions.md).")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--family", required=True, help="model family name, e.g. qwen3")
    live = parser.add_mutually_exclusive_group()
    live.add_argument("--serve", action="store_true",
                      help="also start `milepost serve` on this checkpoint for the live check")
    live.add_argument("--engine-url", help="a running engine serving this checkpoint")
    parser.add_argument("--turns", type=int, default=3, help="model calls of the live check")
    parser.add_argument("--prompt", action="append", default=None,
                        help="a user message of the live check (repeat for later user turns)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from milepost.session.families import FamilyError

    if not Path(ns.model).is_dir():
        print(f"check-family: --model {ns.model} is not a checkpoint directory")
        return 2
    try:
        results = cpu_check(ns.model, ns.family)
    except (FamilyError, OSError, ValueError) as e:
        print(f"check-family: {e}")
        return 2
    _print("CPU append-only check", results)
    failed = not all(r.ok for r in results)
    prompts = tuple(ns.prompt) if ns.prompt else USER_TURNS
    if not failed and (ns.serve or ns.engine_url):
        if ns.serve:
            from milepost.testing.server_process import ServerProcess

            with ServerProcess(ns.model, timeout_s=600) as engine:
                live = live_check(ns.model, ns.family, engine.url, ns.turns, ns.max_tokens,
                                  prompts)
        else:
            live = live_check(ns.model, ns.family, ns.engine_url, ns.turns, ns.max_tokens,
                              prompts)
        _print("live check", live)
        failed = not all(r.ok for r in live)
    return 1 if failed else 0


def _print(title: str, results: list[CheckResult]) -> None:
    print(f"{title}:")
    for r in results:
        print(f"  {'ok  ' if r.ok else 'FAIL'} {r.name}" + (f": {r.detail}" if r.detail else ""))
