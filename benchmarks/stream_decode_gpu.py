"""Stream-K decode GEMMs (milepost/kernels/stream_decode.py) against what the engine runs today, on
the GPU, one call (issues 23 and 27):

* fp8 blockwise: the split-K decode kernel with its table config (`decode_block_mm_quantized`,
  the call the engine makes on an activation its norm quantized) against the stream-K kernel
  over a grid of configs, on the same prequantized activation;
* bf16: cuBLAS (`F.linear`, the engine's bf16 projections) against the stream-K kernel's grid.

Per projection of the Qwen3-4B / 0.6B shapes and decode M. Every time is per call from a CUDA
graph over enough weight copies to overflow L2 (fp8_gemm_sweep.Case); every output is checked
first (fp8: against the emulated product; bf16: against F.linear, 1% of each row's largest
value). Prints µs, the weight's bytes over the time (TB/s), the best stream config and the ratio
to today's GEMM; `--json-out` keeps it all.

    PYTHONPATH=$PWD python3 benchmarks/stream_decode_gpu.py --shapes qwen3-4b --ms 64,256
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_gemm_sweep as sweep  # noqa: E402

from milepost.kernels import fp8_decode  # noqa: E402
from milepost.kernels.fp8_quant import _sm_count, quantize_act_1x128  # noqa: E402
from milepost.kernels.stream_decode import StreamConfig, stream_config, stream_mm  # noqa: E402


def grid(m: int, n: int, k: int, fp8: bool, quick: bool) -> list[StreamConfig]:
    """The rule's config first, then weight tiles 64/128 wide, 3-8 stages, 1-2 programs an SM,
    128-wide K blocks (the shapes' K are multiples of 128); swapped (x's rows on the MMA's N
    side) where M fits 16-32 rows, both at 64, plain above."""
    bm = max(16, min(64, 1 << max(0, (m - 1).bit_length())))
    swaps = (True,) if bm < 64 else ((True, False) if m <= 64 else (False,))
    stages = (4, 6) if quick else (3, 4, 6, 8)
    out = []
    for swap, bn, st, per_sm in itertools.product(swaps, (64, 128), stages, (1, 2)):
        out.append(StreamConfig(bm, bn, 128, swap, 4, st, per_sm))
    rule = stream_config(m, n, k, fp8)  # what the engine runs
    return [rule] + [c for c in out if c != rule]


def _agrees16(out: torch.Tensor, ref: torch.Tensor) -> bool:
    tol = 1e-2 * ref.abs().amax(1, keepdim=True) + 1e-6
    return bool(torch.isfinite(out).all() and ((out - ref).abs() <= tol).all())


def _time16(case: sweep.Case, fn, x: torch.Tensor, ref: torch.Tensor) -> float | str:
    try:
        out = fn(x, 0).float()
        if not _agrees16(out, ref):
            return f"wrong (max diff {(out - ref).abs().max().item():.3g})"
        us, outs = sweep.graph_us([lambda i=i: fn(x, i) for i in range(case.copies)])
        if not _agrees16(outs[0].float(), ref):
            return "wrong in the graph"
        return us
    except Exception as e:  # noqa: BLE001 - report, go on
        return f"failed: {str(e).splitlines()[0][:100]}"


def _best(times: dict[str, float | str]) -> tuple[str | None, float | None]:
    ok = {c: t for c, t in times.items() if isinstance(t, float)}
    if not ok:
        return None, None
    c = min(ok, key=ok.__getitem__)
    return c, ok[c]


def case_row(case: sweep.Case, m: int, sms: int, deadline: float, quick: bool) -> dict:
    dev = case.wq[0].device
    x = torch.randn(m, case.k, device=dev, dtype=torch.bfloat16)
    row: dict = {"M": m, "N": case.n, "K": case.k, "copies": case.copies}
    # fp8: today's split-K kernel (table config) vs the stream grid, one prequantized activation
    ref8 = case.reference(x)
    xq, sx = quantize_act_1x128(x, 4)
    row["fp8_splitk_us"] = case.time(lambda x, i: fp8_decode.decode_block_mm_quantized(
        xq, sx, m, case.wq[i], case.sw[i], torch.bfloat16), x, ref8)
    fp8_grid: dict[str, float | str] = {}
    half = time.time() + (deadline - time.time()) / 2  # fp8's grid, then bf16's
    for cfg in grid(m, case.n, case.k, True, quick):
        if time.time() > half:
            break
        fp8_grid[str(tuple(cfg))] = case.time(lambda x, i, c=cfg: stream_mm(
            xq, case.wq[i], torch.bfloat16, sx=sx, sw=case.sw[i], m=m, cfg=c), x, ref8)
    best, best_us = _best(fp8_grid)
    if best is not None:  # the best with the pieces summed by the second kernel instead
        cfg = StreamConfig(*eval(best))._replace(ticket=False)  # noqa: S307
        fp8_grid[str(tuple(cfg))] = case.time(lambda x, i: stream_mm(
            xq, case.wq[i], torch.bfloat16, sx=sx, sw=case.sw[i], m=m, cfg=cfg), x, ref8)
    row.update(fp8_stream_best=best, fp8_stream_us=best_us, fp8_grid=fp8_grid)
    # bf16: cuBLAS vs the stream grid
    ref16 = F.linear(x, case.wb[0]).float()
    row["bf16_cublas_us"] = _time16(case, lambda x, i: F.linear(x, case.wb[i]), x, ref16)
    bf_grid: dict[str, float | str] = {}
    for cfg in grid(m, case.n, case.k, False, quick):
        if time.time() > deadline:
            break
        bf_grid[str(tuple(cfg))] = _time16(case, lambda x, i, c=cfg: stream_mm(
            x, case.wb[i], torch.bfloat16, cfg=c), x, ref16)
    best, best_us = _best(bf_grid)
    row.update(bf16_stream_best=best, bf16_stream_us=best_us, bf16_grid=bf_grid)
    return row


def fmt(t) -> str:
    return f"{t:7.2f}" if isinstance(t, float) else f"{'-':>7}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-4b,qwen3-0.6b")
    p.add_argument("--ms", default="1,16,64,128,256")
    p.add_argument("--quick", action="store_true", help="stages 4 and 6 only")
    p.add_argument("--budget", type=float, default=480.0, help="seconds; configs past it are skipped")
    p.add_argument("--json-out", default="")
    a = p.parse_args()
    dev = torch.device("cuda")
    sms = _sm_count(dev)
    deadline = time.time() + a.budget
    rows = []
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; us per call from CUDA graphs, TB/s of weight bytes")
    print(f"{'shape':>10} {'proj':>7} {'M':>4} | fp8 splitK  stream  x      TB/s | bf16 cuBLAS  stream  x      TB/s"
          " | best fp8 / bf16 stream config (bm, bn, bk, swap, warps, stages, per_sm, ticket)")
    ms = [int(v) for v in a.ms.split(",")]
    rows_left = len(a.shapes.split(",")) * 4 * len(ms)
    for shape in a.shapes.split(","):
        for proj, (n, k) in sweep.LINEARS[shape].items():
            case = sweep.Case(n, k, dev)
            for m in ms:
                if time.time() > deadline:
                    print(f"{shape} {proj} M={m}: skipped (time budget)")
                    continue
                # each row gets an equal share of the time left: a slow first row (compiles)
                # does not starve the projections after it
                row_deadline = time.time() + (deadline - time.time()) / rows_left
                rows_left -= 1
                r = case_row(case, m, sms, row_deadline, a.quick)
                r.update(shape=shape, proj=proj)
                rows.append(r)
                f8x = (r["fp8_splitk_us"] / r["fp8_stream_us"]
                       if isinstance(r["fp8_splitk_us"], float) and r["fp8_stream_us"] else None)
                bfx = (r["bf16_cublas_us"] / r["bf16_stream_us"]
                       if isinstance(r["bf16_cublas_us"], float) and r["bf16_stream_us"] else None)
                tb8 = n * k / r["fp8_stream_us"] / 1e6 if r["fp8_stream_us"] else None
                tb16 = 2 * n * k / r["bf16_stream_us"] / 1e6 if r["bf16_stream_us"] else None
                print(f"{shape:>10} {proj:>7} {m:>4} | {fmt(r['fp8_splitk_us'])} {fmt(r['fp8_stream_us'])} "
                      f"{fmt(f8x)} {fmt(tb8)} | {fmt(r['bf16_cublas_us'])} {fmt(r['bf16_stream_us'])} "
                      f"{fmt(bfx)} {fmt(tb16)} | {r['fp8_stream_best']} / {r['bf16_stream_best']}", flush=True)
            del case
            torch.cuda.empty_cache()
    for shape in a.shapes.split(","):  # one layer's four projections
        for m in (int(v) for v in a.ms.split(",")):
            rs = [r for r in rows if r["shape"] == shape and r["M"] == m]
            if len(rs) == 4:
                def total(key: str, rs: list = rs) -> float | None:
                    vals = [r[key] for r in rs]
                    return sum(vals) if all(isinstance(v, float) for v in vals) else None
                print(f"{shape} M={m} layer: fp8 splitK {fmt(total('fp8_splitk_us'))} stream "
                      f"{fmt(total('fp8_stream_us'))}; bf16 cuBLAS {fmt(total('bf16_cublas_us'))} "
                      f"stream {fmt(total('bf16_stream_us'))} us")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
