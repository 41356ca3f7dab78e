"""Token-by-token streaming through the session server against a plain (non-streamed) turn, same
engine, same sessions, same run: time to the first content delta, whole-turn latency, and the
number of delta chunks per turn.

    python benchmarks/session_stream.py [--sessions 8] [--turns 4] [--tokens 128]

Model: a tiny random Qwen3 with the tiny tokenizer; every reply is exactly `--tokens` tokens
(ignore_eos), so both modes generate the same amount. sessions x turns requests per mode, one
at a time, the modes alternating request by request.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from milepost.session.runner import SessionServerThread
from milepost.session.service import SessionSettings
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess


def turn(http: httpx.Client, url: str, messages: list[dict], stream: bool,
         ) -> tuple[float, float | None, int, dict]:
    """(whole-turn seconds, seconds to the first non-empty delta, chunks, stored reply)."""
    start = time.perf_counter()
    body = {"messages": messages, "stream": stream}
    if not stream:
        r = http.post(url, json=body)
        r.raise_for_status()
        return time.perf_counter() - start, None, 0, r.json()["choices"][0]["message"]
    first, chunks = None, 0
    with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            if first is None and ('"content": "' in line and '"content": ""' not in line
                                  or '"reasoning_content": "' in line):
                first = time.perf_counter() - start
    return time.perf_counter() - start, first, chunks, {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "m", "qwen3")
        sampling = {"max_new_tokens": args.tokens, "ignore_eos": True, "temperature": 1.0}
        with ServerProcess(model, "--max-total-tokens", "65536") as engine, \
                SessionServerThread(model, engine.url, family="qwen3",
                                    settings=SessionSettings(sampling=sampling,
                                                             enforce_sampling=True)) as srv, \
                httpx.Client(base_url=srv.url, timeout=600) as http:
            results: dict[bool, list[tuple[float, float | None, int]]] = {False: [], True: []}
            # Every reply stops at the length limit (ignore_eos), and a truncated turn cannot be
            # extended: each turn is the first of its own session.
            for s in range(2 * args.sessions * args.turns):
                stream = (s % 2 == 1)
                sid = http.post("/sessions").json()["session_id"]
                messages = [{"role": "user", "content": f"request {s}: go on " * (1 + s % 5)}]
                wall, first, chunks, _ = turn(http, f"/sessions/{sid}/v1/chat/completions",
                                              messages, stream)
                results[stream].append((wall, first, chunks))
    plain = [w for w, _, _ in results[False]]
    streamed = [w for w, _, _ in results[True]]
    firsts = [f for _, f, _ in results[True] if f is not None]
    chunks = [c for _, _, c in results[True]]
    p50 = statistics.median
    print(f"turns per mode: {len(plain)}, {args.tokens} tokens each")
    print(f"plain turn      p50 {p50(plain) * 1e3:8.1f} ms   mean {statistics.fmean(plain) * 1e3:8.1f} ms")
    print(f"streamed turn   p50 {p50(streamed) * 1e3:8.1f} ms   mean {statistics.fmean(streamed) * 1e3:8.1f} ms"
          f"   (x{p50(streamed) / p50(plain):.2f} of plain)")
    print(f"first delta     p50 {p50(firsts) * 1e3:8.1f} ms   ({p50(firsts) / p50(plain):.2f} of a plain "
          f"turn; {len(firsts)}/{len(streamed)} turns had text)")
    print(f"chunks per streamed turn: p50 {p50(chunks):.0f} (tokens {args.tokens})")


if __name__ == "__main__":
    main()
