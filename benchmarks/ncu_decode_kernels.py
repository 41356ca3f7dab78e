"""The kernels of a Qwen3-0.6B decode step at benchmark (a)'s size, once each, for Nsight Compute.

Everything runs once outside the profiled range (compiles, cuBLAS heuristics), then once inside
`torch.cuda.profiler.start()` / `stop()`: the paged decode attention (256 sequences x 256 keys,
16 q / 8 kv heads, 16-token pages at random, the engine's default config) and the layer's four
projections at M = 256 (qkv, o, gate_up, down). Run under ncu so that only that range is read:

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 benchmarks/ncu_decode_kernels.py

Without ncu it prints each kernel's median time (triton.testing.do_bench) and its bytes a second,
the numbers ncu's counters are read against.
"""

from __future__ import annotations

import argparse

import torch
import triton

from milepost.kernels import paged_attention as K

H, HKV, D, PAGE = 16, 8, 128, 16
# (name, N, K) of Qwen3-0.6B's projections: hidden 1024, 16 x 128 q, 8 x 128 k and v, MLP 3072
PROJECTIONS = (("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=256)
    a = ap.parse_args()
    torch.manual_seed(0)
    nb = a.batch * (-(-a.ctx // PAGE))
    kc = torch.randn(nb * PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(a.batch, H, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(nb, device="cuda", dtype=torch.int32).view(a.batch, -1)
    lens = torch.full((a.batch,), a.ctx, device="cuda", dtype=torch.int32)
    splits = K.decode_splits(a.batch, HKV, torch.cuda.get_device_properties(0).multi_processor_count)
    mats = [(name, torch.randn(a.batch, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for name, n, k in PROJECTIONS]

    def attention() -> torch.Tensor:
        return K.paged_decode(q, kc, vc, tables, lens, D**-0.5, PAGE, splits)

    kv_bytes = 2 * kc[: a.batch * a.ctx].numel() * kc.element_size()
    ms = triton.testing.do_bench(attention, return_mode="median")
    print(f"attention B={a.batch} ctx={a.ctx} splits={splits}: {ms * 1e3:.1f} us, "
          f"{kv_bytes / ms / 1e9:.2f} TB/s of K and V")
    for name, x, w in mats:
        ms = triton.testing.do_bench(lambda: x @ w.T, return_mode="median")  # noqa: B023
        flops = 2 * x.shape[0] * w.shape[0] * w.shape[1]
        print(f"{name} M={x.shape[0]} N={w.shape[0]} K={w.shape[1]}: {ms * 1e3:.1f} us, "
              f"{w.numel() * 2 / ms / 1e9:.2f} TB/s of weights, {flops / ms / 1e9:.0f} TFLOP/s")
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    attention()
    for _, x, w in mats:
        x @ w.T
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
