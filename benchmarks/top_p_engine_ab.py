"""Top-p requests in the engine: wide rows' nucleus on the device (kernels/top_p_wide.py, no
read-back, the overlap schedule kept) against the host path (which rows are wide read back each
step, those rows sorted whole), in one process.

    PYTHONPATH=$PWD python benchmarks/top_p_engine_ab.py [--shape qwen3-0.6b] [--top-p 0.95] [--temperatures 1,0.3]

Benchmark (a) (256 x 128 -> 256, random weights) at each temperature with top_p, each path
`--reps` times in turn after a warm-up. With random weights at T = 1 every row is flat, so every
row is wide (the kernel's worst case); a lower temperature makes fewer rows wide.
"""

from __future__ import annotations

import argparse

import torch

import milepost.engine.sampling as sampling
from benchmarks.switch_ab import alternate, started_engine
from milepost.bench import workloads
from milepost.bench.engine_side import EngineBench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--temperatures", default="1,0.3")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    engine, native = started_engine(a.shape)
    n, out = (256, 256) if torch.cuda.is_available() else (16, 16)
    real = sampling._nucleus
    try:
        for t in (float(x) for x in a.temperatures.split(",")):
            bench = EngineBench(engine, t, top_p=a.top_p)
            bench.run(workloads.fixed(n, 128, 8, native.vocab_size, 99))  # warm-up

            def run(on_device: bool, rep: int, t: float = t, bench: EngineBench = bench) -> float:
                sampling._nucleus = lambda p, tp: real(p, tp, on_device=on_device)
                r = bench.run(workloads.fixed(n, 128, out, native.vocab_size, rep))
                step = 1e3 * r.decode_seconds / max(r.decode_steps, 1)
                print(f"== T={t} top_p={a.top_p} {'device' if on_device else 'host'} path, run "
                      f"{rep + 1}: {r.output_tokens / r.seconds:,.0f} tok/s, decode step {step:.2f} ms",
                      flush=True)
                return r.output_tokens / r.seconds

            on, off = alternate(a.reps, run)
            print(f"## {a.shape} T={t} top_p={a.top_p}: device path {on:,.0f} tok/s vs host path "
                  f"{off:,.0f} (x{on / off:.3f}, medians of {a.reps})", flush=True)
    finally:
        sampling._nucleus = real
        engine.close()


if __name__ == "__main__":
    main()
