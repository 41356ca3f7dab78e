"""Decode-M bf16 GEMMs: cuBLAS (`torch.mm`, what the engine runs) against a plain Triton tiled GEMM
with and without split-K, on the projection shapes of a decode step.

At M = 64-256 rows an N = 1024 output (o_proj, down_proj of the 0.6B shape) has only 16-32
128 x 128 tiles for 132 SMs; this measures whether smaller tiles or split-K beat cuBLAS's pick.
Median of `triton.testing.do_bench`; each Triton result is checked against torch.mm.

Usage: python benchmarks/decode_gemm_sweep.py [--shapes qwen3-0.6b,qwen3-4b] [--rows 64,256]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
import triton.language as tl

SHAPES = {  # (name, N, K) of each projection: fused qkv, o, fused gate/up, down
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072)],
    "qwen3-4b": [("qkv", 6144, 2560), ("o", 2560, 4096), ("gate_up", 19456, 2560), ("down", 2560, 9728)],
}


@triton.jit
def _mm_kernel(A, B, C, M, N, K, stride_am, stride_bn, stride_cs, stride_cm, BM: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr):
    """C[split] = A[:, range] @ B[:, range].T over this split's K range (B is [N, K], a weight)."""
    pm, pn, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    per = tl.cdiv(K, SPLIT * BK) * BK
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(ps * per, tl.minimum((ps + 1) * per, K), BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(A + rm[:, None] * stride_am + rk[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(B + rn[:, None] * stride_bn + rk[None, :], mask=rn[:, None] < N, other=0.0)
        acc += tl.dot(a, tl.trans(b))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(C + ps * stride_cs + rm[:, None] * stride_cm + rn[None, :], acc, mask=mask)


def triton_mm(a: torch.Tensor, b: torch.Tensor, bm: int, bn: int, bk: int, split: int, warps: int,
              stages: int) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _mm_kernel[grid](a, b, c, m, n, k, a.stride(0), b.stride(0), c.stride(0), c.stride(1), BM=bm,
                     BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages)
    return (c[0] if split == 1 else c.sum(0)).to(a.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="qwen3-0.6b,qwen3-4b")
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--top", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    for shape in a.shapes.split(","):
        total_cublas = {m: 0.0 for m in map(int, a.rows.split(","))}
        total_best = dict(total_cublas)
        for (name, n, k), m in itertools.product(SHAPES[shape], total_cublas):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            ref = x @ w.T
            cublas = triton.testing.do_bench(lambda: x @ w.T, return_mode="median")
            rows = []
            for bm, bn, bk, split, warps, stages in itertools.product(
                    (64, 128), (64, 128), (64, 128), (1, 2, 4), (4,), (4,)):
                if bm > m:
                    continue
                try:
                    err = (triton_mm(x, w, bm, bn, bk, split, warps, stages).float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(lambda: triton_mm(x, w, bm, bn, bk, split, warps, stages),
                                                 return_mode="median")
                except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
                    print(f"    {name} M={m} BM={bm} BN={bn} BK={bk} split={split}: failed {e!r:.80}")
                    continue
                rows.append((ms, bm, bn, bk, split, warps, stages, err))
            rows.sort()
            gb = (n * k + m * k + m * n) * 2 / 1e9
            total_cublas[m] += cublas
            total_best[m] += min(cublas, rows[0][0]) if rows else cublas
            print(f"{shape} {name} M={m} N={n} K={k}: cuBLAS {cublas * 1e3:.1f} us ({gb / cublas:.2f} TB/s); "
                  + "; ".join(f"BM={bm} BN={bn} BK={bk} split={s} st={st} {ms * 1e3:.1f} us "
                              f"(x{cublas / ms:.2f}, err {err:.1e})"
                              for ms, bm, bn, bk, s, w_, st, err in rows[:a.top]), flush=True)
        for m in total_cublas:
            print(f"{shape} M={m}: one layer's four GEMMs cuBLAS {total_cublas[m] * 1e3:.1f} us, "
                  f"best of cuBLAS / Triton each {total_best[m] * 1e3:.1f} us")


if __name__ == "__main__":
    main()
