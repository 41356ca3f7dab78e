"""The engine's sampler on the GPU: the torch sampler vs the fused temperature-only sampler
(milepost/kernels/fused_sampler.py) on Qwen3-size logits, the kernel alone over its work layouts
(splits per row, warps) and the whole `sample()` call as the engine makes it.

    python benchmarks/sampler_gpu.py [--rows 64,256] [--vocab 151936]
"""

from __future__ import annotations

import argparse

import torch

from milepost.engine.sampling import SamplingParams, sample
from milepost.kernels.fused_sampler import fused_sample


def gpu_ms(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--vocab", type=int, default=151_936)
    a = ap.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    for rows in (int(r) for r in a.rows.split(",")):
        logits = torch.randn(rows, a.vocab, device="cuda", generator=gen) * 3
        params = [SamplingParams(temperature=1.0)] * rows
        gens, banned = [gen] * rows, [[] for _ in range(rows)]
        torch_ms = gpu_ms(lambda: sample(logits, params, gens, banned, 0))
        fused_ms = gpu_ms(lambda: sample(logits, params, gens, banned, 0, fused=True))
        print(f"rows {rows} x vocab {a.vocab}: sample() torch {torch_ms * 1e3:.0f} us, fused "
              f"{fused_ms * 1e3:.0f} us ({torch_ms / fused_ms:.1f}x); the read of fp32 logits at "
              f"4.8 TB/s: {logits.numel() * 4 / 4.8e12 * 1e6:.0f} us")
        temps = torch.ones(rows, device="cuda")
        greedy = torch.zeros(rows, dtype=torch.int8, device="cuda")
        seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
        times = []
        for splits in (4, 8, 16, 32):
            for warps in (2, 4, 8, 16):
                ms = gpu_ms(lambda: fused_sample(logits, temps, greedy, seeds, splits, warps))
                times.append((ms, splits, warps))
        times.sort()
        print("  kernel alone, best layouts: " + "; ".join(
            f"splits={s} warps={w} {ms * 1e3:.0f} us" for ms, s, w in times[:5])
            + f"; default (8, 8): {[t for t in times if t[1:] == (8, 8)][0][0] * 1e3:.0f} us")


if __name__ == "__main__":
    main()
