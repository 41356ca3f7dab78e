"""The rollout client's cost per request: EngineClient over aiohttp (ours) vs over httpx's own pool.

    python benchmarks/rollout_client.py [--concurrency 256] [--rounds 5] [--model DIR]

Starts one `milepost serve` on a tiny checkpoint (or --model), then sends rounds of
`--concurrency` concurrent /generate requests (8 new tokens, temperature 1: a demo rollout's
shape) through `EngineClient` with each transport, alternating, and prints per round the wall
time and this process's CPU time (the client's cost: it runs on the trainer's rank 0), then the
medians and the httpx/aiohttp ratio. The engine's own work is the same for both.
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

from milepost.rollout.client import EngineClient
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess


async def _round(client: EngineClient, concurrency: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client.generate([1 + i % 50, 2, 3, 4, 5, 6], {"max_new_tokens": 8, "temperature": 1.0})
                           for i in range(concurrency)))
    return time.perf_counter() - t0, time.process_time() - c0


async def _rounds(url: str, transport: httpx.AsyncBaseTransport | None, concurrency: int,
                  rounds: int) -> list[tuple[float, float]]:
    async with EngineClient(url, transport=transport) as c:
        await _round(c, concurrency)  # warm: connections open, engine warm
        return [await _round(c, concurrency) for _ in range(rounds)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", type=Path, default=None, help="a Hugging Face directory (default: a tiny Qwen3)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "m"
            make_tiny_checkpoint(model, "qwen3", seed=0)
        with ServerProcess(model, "--max-total-tokens", str(max(4096, 16 * args.concurrency))) as srv:
            results = {"aiohttp": [], "httpx": []}
            for _ in range(args.rounds):  # alternate, so load changes hit both alike
                # httpx's own pool: what EngineClient used before (no connection limit)
                pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None,
                                                                    max_keepalive_connections=256))
                for name, transport in (("aiohttp", None), ("httpx", pool)):
                    wall, cpu = asyncio.run(_rounds(srv.url, transport, args.concurrency, 1))[0]
                    results[name].append((wall, cpu))
                    print(f"{name:8s} {args.concurrency} requests: {wall:6.2f} s wall, {cpu:5.2f} s client CPU",
                          flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in results.items()}
    for k, (w, c) in med.items():
        print(f"median {k:8s}: {w:.2f} s wall, {c:.3f} s client CPU ({1000 * c / args.concurrency:.2f} ms/request)")
    print(f"httpx / aiohttp: wall {med['httpx'][0] / med['aiohttp'][0]:.1f}x, "
          f"client CPU {med['httpx'][1] / med['aiohttp'][1]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
