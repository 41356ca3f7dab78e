"""Multi-turn sessions through the session server, 2 engines behind the real sglang-router:
prefix-cache hit rate with session affinity (policy manual, assignment min_load, routing key =
session id) against load-based routing (policy round_robin), same engines, same sessions, same
run; and the session server's own time per turn (generation excluded).

    python benchmarks/session_affinity.py [--sessions 16] [--turns 10] [--concurrency 8]

Model: a tiny random Qwen3 with the tiny tokenizer. Its replies end by stopping on an eighth of
the vocabulary (stop_token_ids: ~8 tokens, never the length limit), so a turn is mostly prefill
of the growing history: an agent's shared system prompt with tools (~1.3k tokens), then per turn
a user message of ~60 tokens.
Hit rate = sum(cached_tokens) / sum(prompt_tokens) over every turn of every session, as the
engines report them (SGLang's `cached_tokens`). Engines run with --page-size 1 (SGLang's default
radix cache granularity), so a hit is counted to the token.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from milepost.launch.process import ManagedProcess, free_port
from milepost.session.runner import SessionServerThread
from milepost.session.service import SessionSettings
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess

SYSTEM = ("You are a careful agent working in a terminal. Use the tools when they help; answer "
          "briefly. " * 12)
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": "Does step " * 4,
                                           "parameters": {"type": "object", "properties": {}}}}
         for i in range(4)]


def start_router(workers: list[str], policy: str, log_dir: Path) -> ManagedProcess:
    port = free_port()
    extra = ["--assignment-mode", "min_load"] if policy == "manual" else []
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
           str(port), "--worker-urls", *workers, "--policy", policy, *extra, "--log-level", "warn"]
    proc = ManagedProcess(f"router-{policy}", cmd, log_dir / f"router-{policy}.log",
                          f"http://127.0.0.1:{port}/health", timeout_s=120)
    proc.url = f"http://127.0.0.1:{port}"
    return proc


async def one_session(http: httpx.AsyncClient, url: str, s: int, turns: int,
                      rows: list[dict], user_repeat: int) -> None:
    sid = (await http.post(f"{url}/sessions")).json()["session_id"]
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Session {s} turn {t}: " + "please look at "
                         f"file_{s}_{t}.txt and count its lines, then report the count. " * user_repeat})
        start = time.perf_counter()
        r = await http.post(f"{url}/sessions/{sid}/v1/chat/completions",
                            json={"messages": messages, "tools": TOOLS})
        wall = time.perf_counter() - start
        if r.status_code != 200:
            raise RuntimeError(f"turn {t} of session {s}: {r.status_code} {r.text[:300]}")
        body = r.json()
        messages.append(body["choices"][0]["message"])
        rows.append({"turn": t, "prompt": body["usage"]["prompt_tokens"],
                     "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
                     "overhead_ms": body["milepost"]["overhead_ms"],
                     "generate_ms": body["milepost"]["generate_ms"], "wall_ms": wall * 1e3})
    await http.delete(f"{url}/sessions/{sid}")


async def workload(url: str, sessions: int, turns: int, concurrency: int,
                   user_repeat: int) -> list[dict]:
    rows: list[dict] = []
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as http:
        async def run(s: int) -> None:
            async with slots:
                await one_session(http, url, s, turns, rows, user_repeat)
        await asyncio.gather(*(run(s) for s in range(sessions)))
    return rows


def summarize(rows: list[dict]) -> dict[str, float]:
    later = [r for r in rows if r["turn"] > 0]
    return {
        "hit_rate": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
        "hit_rate_turns_2_plus": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
        "overhead_p50_ms": statistics.median(r["overhead_ms"] for r in rows),
        "overhead_p90_ms": statistics.quantiles([r["overhead_ms"] for r in rows], n=10)[-1],
        "generate_p50_ms": statistics.median(r["generate_ms"] for r in rows),
        "client_minus_generate_p50_ms": statistics.median(r["wall_ms"] - r["generate_ms"]
                                                          for r in rows),
        "turns": len(rows),
        "prompt_tokens_mean": statistics.mean(r["prompt"] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--user-repeat", type=int, default=2,
                    help="length of each user message (~60 tokens per repeat)")
    ap.add_argument("--stop-every", type=int, default=8,
                    help="stop on one vocabulary id in N: replies of ~N tokens")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: engine i on GPU i (one GPU: both share it)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="session_affinity_"))
    # A context of 8192 tokens (agent sessions are long); the tiny shape is otherwise unchanged.
    model = make_tiny_checkpoint(work / "model", "qwen3", max_position_embeddings=8192)
    sampling = {"max_new_tokens": 16 * args.stop_every, "temperature": 1.0,  # ~never "length"
                "stop_token_ids": list(range(7, 512, args.stop_every))}
    flags = ("--max-total-tokens", "200000", "--page-size", "1", "--device", args.device)
    envs: list[dict[str, str]] = [{}, {}]
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        envs = [{"CUDA_VISIBLE_DEVICES": str(i % gpus)} for i in range(2)]
        flags += ("--mem-fraction-static", "0.4" if gpus == 1 else "0.8")
    with ServerProcess(model, *flags, env=envs[0]) as e1, \
            ServerProcess(model, *flags, env=envs[1]) as e2:
        results = {}
        for policy in ("manual", "round_robin"):
            for e in (e1, e2):
                httpx.post(f"{e.url}/flush_cache", timeout=30).raise_for_status()
            with start_router([e1.url, e2.url], policy, work) as router, SessionServerThread(
                    model, router.url, family="qwen3",
                    settings=SessionSettings(sampling=sampling, enforce_sampling=True)) as srv:
                rows = asyncio.run(workload(srv.url, args.sessions, args.turns, args.concurrency,
                                            args.user_repeat))
            results[policy] = summarize(rows)
    aff, load = results["manual"], results["round_robin"]
    print(f"user messages x{args.user_repeat}, replies ~{args.stop_every} tokens")
    print(f"{args.sessions} sessions x {args.turns} turns (mean prompt "
          f"{aff['prompt_tokens_mean']:.0f} tokens), concurrency {args.concurrency}, "
          f"2 engines behind sglang-router")
    for name, r in (("affinity (manual, min_load, key=session)", aff),
                    ("load-based (round_robin)", load)):
        print(f"  {name:42s} hit rate {r['hit_rate']:.3f} (turns 2+: "
              f"{r['hit_rate_turns_2_plus']:.3f})  server overhead/turn p50 "
              f"{r['overhead_p50_ms']:.2f} ms p90 {r['overhead_p90_ms']:.2f} ms  generate p50 "
              f"{r['generate_p50_ms']:.1f} ms  client-minus-generate p50 "
              f"{r['client_minus_generate_p50_ms']:.1f} ms")
    print(f"  hit rate ratio affinity / load-based: {aff['hit_rate'] / load['hit_rate']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
