"""Trajectory transfer: raw bytes vs JSON through a real diffusion engine (issue 29).

Starts `python -m milepost.diffusion.server` on a loopback port with a tiny random DiT, asks for
the same trajectories in both formats, and prints per format: body size, request time (engine
generation included, the same in both) and decode time, plus the decode time of the raw path in
a process pool (what the RL loop does: off the event loop). Usage:
    python benchmarks/diffusion_transfer.py [--device cuda] [--batch 16] [--steps 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    from milepost.diffusion.codec import decode
    from milepost.diffusion.model import DiTConfig, TinyDiT, save_model
    from milepost.launch.process import ManagedProcess, free_port

    work = Path(tempfile.mkdtemp(prefix="diffusion-transfer-"))
    torch.manual_seed(0)
    save_model(TinyDiT(DiTConfig()), work / "dit")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "milepost.diffusion.server", "--model-path", str(work / "dit"), "--port", str(port),
           "--device", args.device]
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    pool.submit(sum, [1]).result()  # start the worker before timing
    with ManagedProcess("diffusion-engine", cmd, work / "engine.log", f"{url}/health", timeout_s=300.0):
        body = {"labels": [0] * args.batch, "seed": 0, "num_steps": args.steps}
        httpx.post(f"{url}/generate", json=body, timeout=600).raise_for_status()  # warm-up
        print(f"device {args.device}, {args.batch} images x {args.steps} steps, {args.repeats} repeats (median)")
        print(f"{'format':>8} {'body MB':>9} {'request s':>10} {'decode s':>9} {'pool decode s':>14}")
        for fmt in ("bytes", "json"):
            req, dec, pooled, size = [], [], [], 0
            for _ in range(args.repeats):
                t = time.perf_counter()
                r = httpx.post(f"{url}/generate", json={**body, "return_format": fmt}, timeout=600)
                req.append(time.perf_counter() - t)
                r.raise_for_status()
                size = len(r.content)
                ctype = r.headers["content-type"]
                t = time.perf_counter()
                decode(r.content, ctype)
                dec.append(time.perf_counter() - t)
                t = time.perf_counter()
                pool.submit(decode, r.content, ctype).result()
                pooled.append(time.perf_counter() - t)
            print(f"{fmt:>8} {size / 1e6:>9.2f} {statistics.median(req):>10.3f} {statistics.median(dec):>9.4f} "
                  f"{statistics.median(pooled):>14.4f}")
    pool.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
