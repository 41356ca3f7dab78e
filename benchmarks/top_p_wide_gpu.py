"""The wide rows' top-p nucleus kernel (kernels/top_p_wide.py) by pivot count, and a top-p sample().

    python benchmarks/top_p_wide_gpu.py [--rows 256] [--vocab 151936] [--top-p 0.95]

Flat rows (random logits at T = 1: every row is wide, the kernel's worst case), each config
timed from a CUDA graph (median of --reps replays): PIVOTS = 1 is the former bisection. Every
config's output is compared with the first one's (rows whose kept set differs: only a cut within
float rounding of the limit may move). Then `sampling.sample()` on the same logits with top_p
against top_p = 1, and `_nucleus` alone, at the module's default config.
"""

from __future__ import annotations

import argparse
import torch

import milepost.engine.sampling as sampling
import milepost.kernels.top_p_wide as kernel
from benchmarks.lowprec_gpu import cuda_ms
from benchmarks.moe_sweep import graph_ms
from milepost.engine.sampling_params import SamplingParams

CONFIGS = [  # (pivots, search block, warps); session 32 on an H100 also timed (15, 512, 8),
    # (15, 256, 4), (31, 256, 8), (7, 512, 8), (1, 4096 / 8192, 8), (3, 1024, 8), (7, 1024, 8),
    # (15, 1024 / 2048, 8 / 16): all slower than (7, 2048, 8)
    (1, 1024, 4), (3, 2048, 8), (3, 4096, 8), (7, 2048, 4), (7, 2048, 8), (7, 2048, 16),
    (7, 4096, 8), (7, 4096, 16), (15, 1024, 8),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(a.rows, a.vocab, device="cuda", generator=g)
    probs = torch.softmax(logits, dim=1)
    limit = (a.top_p * probs.sum(dim=1)).float()
    wide = torch.ones(a.rows, dtype=torch.bool, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {a.rows} flat rows x {a.vocab}, top_p {a.top_p}")
    first = None
    defaults = (kernel.PIVOTS, kernel.SEARCH_BLOCK, kernel.NUM_WARPS)
    for pivots, block, warps in CONFIGS:
        kernel.PIVOTS, kernel.SEARCH_BLOCK, kernel.NUM_WARPS = pivots, block, warps
        out = torch.zeros_like(probs)
        ms = graph_ms(lambda: kernel.nucleus_wide_(probs, out, limit, wide), a.reps)
        kept = out > 0
        if first is None:
            first = (ms, kept)
        moved = int((kept != first[1]).any(dim=1).sum())
        print(f"  pivots {pivots:2d} block {block:4d} warps {warps}: {ms * 1e3:8.1f} us "
              f"(x{first[0] / ms:.2f} of the first); kept {int(kept.sum(dim=1).float().mean())} "
              f"tokens a row; rows whose kept set differs from the first's: {moved}", flush=True)
    kernel.PIVOTS, kernel.SEARCH_BLOCK, kernel.NUM_WARPS = defaults
    top_p = torch.full((a.rows,), a.top_p, device="cuda")
    nuc = cuda_ms(lambda: sampling._nucleus(probs, top_p), a.reps)
    gens = [None] * a.rows
    plain = [SamplingParams(temperature=1.0) for _ in range(a.rows)]
    nucleus = [SamplingParams(temperature=1.0, top_p=a.top_p) for _ in range(a.rows)]
    t_plain = cuda_ms(lambda: sampling.sample(logits, plain, gens, [[] for _ in plain]), a.reps)
    t_top_p = cuda_ms(lambda: sampling.sample(logits, nucleus, gens, [[] for _ in nucleus]), a.reps)
    print(f"default config {defaults}: _nucleus {nuc:.3f} ms; sample() top_p {a.top_p} {t_top_p:.3f} "
          f"ms against top_p 1 {t_plain:.3f} ms (x{t_top_p / t_plain:.2f})")


if __name__ == "__main__":
    main()
