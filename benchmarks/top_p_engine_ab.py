"""Top-p requests in the engine: wide rows' nucleus on the device (kernels/top_p_wide.py, no
read-back, the overlap schedule kept) against the host path (which rows are wide read back each
step, those rows sorted whole), in one process.

    python benchmarks/top_p_engine_ab.py [--shape qwen3-0.6b] [--top-p 0.95] [--temperatures 1,0.3]

Benchmark (a) (256 x 128 -> 256, random weights) at each temperature with top_p, each path
`--reps` times in turn after a warm-up. With random weights at T = 1 every row is flat, so every
row is wide (the kernel's worst case); a lower temperature makes fewer rows wide.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import milepost.engine.sampling as sampling
from milepost.bench import workloads
from milepost.bench.engine_side import EngineBench
from milepost.bench.models import native_model
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--temperatures", default="1,0.3")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    native, cfg_dir = native_model(None, a.shape, torch.bfloat16 if cuda else torch.float32, dev, 0)
    args = ServerArgs(model_path=cfg_dir, device=dev.type, dtype="bfloat16" if cuda else "float32",
                      max_running_requests=256 if cuda else 16, random_seed=0).resolved()
    engine = build_engine(args, model=native)[0]
    engine.start()
    n, out = (256, 256) if cuda else (16, 16)
    real = sampling._nucleus
    try:
        for t in (float(x) for x in a.temperatures.split(",")):
            bench = EngineBench(engine, t, top_p=a.top_p)
            bench.run(workloads.fixed(n, 128, 8, native.vocab_size, 99))  # warm-up
            tok_s: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(a.reps):
                for on_device in (True, False) if rep % 2 == 0 else (False, True):
                    sampling._nucleus = lambda p, tp, d=on_device: real(p, tp, on_device=d)
                    r = bench.run(workloads.fixed(n, 128, out, native.vocab_size, rep))
                    tok_s[on_device].append(r.output_tokens / r.seconds)
                    step = 1e3 * r.decode_seconds / max(r.decode_steps, 1)
                    print(f"== T={t} top_p={a.top_p} {'device' if on_device else 'host'} path, run "
                          f"{rep + 1}: {tok_s[on_device][-1]:,.0f} tok/s, decode step {step:.2f} ms",
                          flush=True)
            on, off = statistics.median(tok_s[True]), statistics.median(tok_s[False])
            print(f"## {a.shape} T={t} top_p={a.top_p}: device path {on:,.0f} tok/s vs host path "
                  f"{off:,.0f} (x{on / off:.3f}, medians of {a.reps})", flush=True)
    finally:
        sampling._nucleus = real
        engine.close()


if __name__ == "__main__":
    main()
