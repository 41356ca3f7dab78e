"""The engine's sampler on the GPU: the torch sampler vs the fused temperature-only sampler's two
methods (milepost/kernels/fused_sampler.py: "race", the exponential race, and "cdf", the inverse
CDF) side by side on Qwen3-size logits, fp32 and bf16 (the decode graphs hand the sampler the LM
head's bf16 output): the whole `sample()` call as the engine makes it, the kernel alone at its
default layout, and (--sweep) the kernel over its work layouts. CUDA events, mean of 50 calls.

    python benchmarks/sampler_gpu.py [--rows 64,256] [--vocab 151936] [--dtypes fp32,bf16] [--sweep]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from unittest import mock

import torch

import milepost.kernels.fused_sampler as fs
from milepost.engine.sampling import SamplingParams, sample

HBM_BYTES_PER_S = 4.8e12  # H200; an H100 SXM reads 3.35e12


def gpu_us(fn: Callable[[], object], reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3


def layouts(method: str) -> list[dict]:
    if method == "race":
        return [{"splits": s, "num_warps": w} for s in (16, 32) for w in (4, 8)]
    return [{"splits": s, "num_warps": w, "chunk": c}
            for c in (2048, 4096) for s in (8, 16, 32, 64) for w in (2, 4, 8)]


def bench(rows: int, vocab: int, dtype: torch.dtype, sweep: bool, gen: torch.Generator) -> None:
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).to(dtype)
    name = str(dtype).removeprefix("torch.")
    read_us = logits.numel() * logits.element_size() / HBM_BYTES_PER_S * 1e6
    params = [SamplingParams(temperature=1.0) for _ in range(rows)]
    gens, banned = [gen] * rows, [[] for _ in range(rows)]
    whole = {"torch": gpu_us(lambda: sample(logits, params, gens, banned, 0))}
    for method in fs.METHODS:
        with mock.patch.object(fs, "METHOD", method):  # what sample(fused=True) runs
            whole[method] = gpu_us(lambda: sample(logits, params, gens, banned, 0, fused=True))
    temps = torch.ones(rows, device="cuda")
    greedy = torch.zeros(rows, dtype=torch.int8, device="cuda")
    seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
    alone = {m: gpu_us(lambda m=m: fs.fused_sample(logits, temps, greedy, seeds, method=m))
             for m in fs.METHODS}
    print(f"rows {rows} x vocab {vocab}, {name} logits (one read at {HBM_BYTES_PER_S / 1e12:.1f} "
          f"TB/s: {read_us:.0f} us)")
    print(f"  sample(): torch {whole['torch']:.0f} us | fused race {whole['race']:.0f} us | "
          f"fused cdf {whole['cdf']:.0f} us (cdf / race {whole['cdf'] / whole['race']:.2f})")
    print(f"  kernel alone, default layout: race {alone['race']:.0f} us | cdf {alone['cdf']:.0f} us "
          f"(race / cdf {alone['race'] / alone['cdf']:.1f}x; cdf at {read_us / alone['cdf']:.0%} "
          "of the read's bound)")
    if not sweep:
        return
    for method in fs.METHODS:
        times = sorted((gpu_us(lambda kw=kw: fs.fused_sample(logits, temps, greedy, seeds,
                                                             method=method, **kw)), kw)
                       for kw in layouts(method))
        print(f"  {method} layouts, best first: " + "; ".join(
            f"{' '.join(f'{k}={v}' for k, v in kw.items())} {us:.0f} us" for us, kw in times[:6]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--sweep", action="store_true", help="also time the kernels' work layouts")
    a = ap.parse_args()
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    gen = torch.Generator("cuda").manual_seed(0)
    for d in a.dtypes.split(","):
        for rows in (int(r) for r in a.rows.split(",")):
            bench(rows, a.vocab, dtypes[d], a.sweep, gen)


if __name__ == "__main__":
    main()
