"""Decode attention kernel configs on benchmark (a)'s shapes and smaller batches: block size,
warps, stages (1: no software pipelining, the loads straight to registers) and splits (the KV of
a sequence split over 1, 2 or 4 times the default's programs). Where the default is unsplit,
also the persistent kernel (`paged_attention.PERSISTENT_DECODE`) at 1-4 programs per SM: the
default kernel's config (64 / 2 warps / 3 stages) always, others where they beat the default.

Qwen3-0.6B heads (16 q / 8 kv, head dim 128; `--heads 32/8` the 4B's), bf16 queries, 16-token pages placed at random; median of
`triton.testing.do_bench`; every variant is checked against the default's output. `--kv-dtype
fp8_e4m3`: over an fp8 pool, the grid and "default" are the widening kernel (paged_attention.py)
and the `words` lines the word-loading kernel the engine runs (`paged_attention.FP8_POOL_WORDS`), at
the default's splits and at 2 and 4 times as many.

Usage: python benchmarks/decode_attention_sweep.py [--shapes 256x256,256x384,64x256,64x1024]
       [--kv-dtype fp8_e4m3 [--words-grid]] [--heads 32/8] [--no-grid]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from milepost.kernels import paged_attention as K
from milepost.kernels import paged_attention_persistent as P

H, HKV, D, PAGE = 16, 8, 128, 16
WORDS_GRID = False  # --words-grid


def _timed(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
           lens: torch.Tensor, ref: torch.Tensor, splits: int, block_n: int, warps: int | None,
           stages: int | None, label: str) -> tuple[float, float] | None:
    """(median ms, max |diff| from ref) of paged_decode in one config; None (reported) if it fails."""
    def run() -> torch.Tensor:
        return K.paged_decode(q, kc, vc, tables, lens, D**-0.5, PAGE, splits, block_n=block_n,
                              num_warps=warps, num_stages=stages)
    try:
        err = (run().float() - ref.float()).abs().max().item()
        return triton.testing.do_bench(run, return_mode="median"), err
    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
        print(f"  {label}: failed {e!r:.120}")
        return None


def sweep(batch: int, ctx: int, top: int, kv_dtype: torch.dtype, grid: bool) -> None:
    """Time the configs on `batch` sequences of `ctx` keys each; print the best and the defaults."""
    nb = batch * (-(-ctx // PAGE))
    kc = torch.randn(nb * PAGE, HKV, D, device="cuda").to(kv_dtype)
    vc = torch.randn(nb * PAGE, HKV, D, device="cuda").to(kv_dtype)
    q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(nb, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    gb = 2 * batch * ctx * HKV * D * kc.element_size() / 1e9
    splits = K.decode_splits(batch, HKV, torch.cuda.get_device_properties(0).multi_processor_count)
    ref = K.paged_decode(q, kc, vc, tables, lens, D**-0.5, PAGE, splits)
    configs = [(splits, 64, None, None)]
    configs += [] if not grid else list(itertools.product(sorted({splits, 2 * splits, 4 * splits, 8 * splits}),
                                      (32, 64, 128), (2, 4), (1, 2, 3)))
    rows = []
    for s, bn, w, st in configs:
        timed = _timed(q, kc, vc, tables, lens, ref, s, bn, w, st, f"splits={s} BN={bn} w={w} st={st}")
        if timed is not None:
            rows.append((timed[0], s, bn, w, st, timed[1]))
    default = rows[0]
    print(f"B={batch} ctx={ctx}: KV {gb:.3f} GB ({kc.dtype}); default (splits={splits}) "
          f"{default[0] * 1e3:.1f} us = {gb / default[0]:.2f} TB/s")
    if splits == 1:  # the persistent kernel (paged_attention_persistent.py), programs per SM
        for per_sm, (bn, w, st) in itertools.product(
                (1, 2, 3, 4), ((64, 2, 3), (64, 2, 2), (64, 4, 2), (32, 2, 3))):
            out = torch.empty_like(q)

            def persistent() -> torch.Tensor:
                return P.persistent_decode(q, kc, vc, tables, lens, D**-0.5, PAGE, out,
                                           block_n=bn, num_warps=w, num_stages=st, per_sm=per_sm)
            try:
                same = torch.equal(persistent(), ref)
                ms = triton.testing.do_bench(persistent, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                print(f"  persistent {per_sm}/SM BN={bn} w={w} st={st}: failed {e!r:.120}")
                continue
            if (bn, w, st) == (64, 2, 3) or ms < default[0]:
                print(f"  persistent {per_sm}/SM BN={bn} w={w} st={st}: {ms * 1e3:.1f} us = "
                      f"{gb / ms:.2f} TB/s, x{default[0] / ms:.2f} default, "
                      f"{'bitwise equal' if same else 'DIFFERS from'} the default's output")
    if kc.dtype == torch.float8_e4m3fn:  # the word-loading kernel (paged_attention_fp8.py)
        K.FP8_POOL_WORDS = True
        try:
            tiles = ((64, None, None), (64, 4, 2), (128, 4, 2), (32, 2, 3))
            split_list = (splits, 2 * splits, 4 * splits)
            if WORDS_GRID:  # the word kernel's own grid at the default's splits and twice them
                tiles = ((64, None, None), *itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)))
                split_list = (splits, 2 * splits)
            for s, (bn, w, st) in itertools.product(split_list, tiles):
                timed = _timed(q, kc, vc, tables, lens, ref, s, bn, w, st,
                               f"words splits={s} BN={bn} w={w} st={st}")
                if timed is None:
                    continue
                ms, err = timed
                print(f"  words splits={s} BN={bn} w={w} st={st}: {ms * 1e3:.1f} us = "
                      f"{gb / ms:.2f} TB/s, x{default[0] / ms:.2f} default, max|diff| {err:.1e}")
        finally:
            K.FP8_POOL_WORDS = False
    for ms, s, bn, w, st, err in sorted(rows, key=lambda r: r[0])[:top]:
        print(f"  splits={s} BN={bn} w={w} st={st}: {ms * 1e3:.1f} us = {gb / ms:.2f} TB/s, "
              f"x{default[0] / ms:.2f} default, max|diff| {err:.1e}")
    for s in sorted({r[1] for r in rows}):
        best = min((r for r in rows if r[1] == s), key=lambda r: r[0])
        print(f"  best at splits={s}: {best[0] * 1e3:.1f} us (x{default[0] / best[0]:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="256x256,256x384,64x256,64x1024")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3"])
    ap.add_argument("--grid", action=argparse.BooleanOptionalAction, default=True,
                    help="the default kernel's block / warp / stage / split grid (--no-grid: the "
                         "default config and the other kernels only)")
    ap.add_argument("--heads", default="16/8", help="query heads / KV heads")
    ap.add_argument("--words-grid", action="store_true",
                    help="--kv-dtype fp8_e4m3: the word-loading kernel's block / warp / stage grid "
                         "(at the default's splits and twice them) instead of its four configs")
    a = ap.parse_args()
    global H, HKV, WORDS_GRID
    WORDS_GRID = a.words_grid
    H, HKV = (int(x) for x in a.heads.split("/"))
    K.FP8_POOL_WORDS = False  # the grid times the widening kernel; the words lines switch it on
    torch.manual_seed(0)
    kv_dtype = torch.float8_e4m3fn if a.kv_dtype == "fp8_e4m3" else torch.bfloat16
    for shape in a.shapes.split(","):
        b, c = (int(x) for x in shape.split("x"))
        sweep(b, c, a.top, kv_dtype, a.grid)


if __name__ == "__main__":
    main()
