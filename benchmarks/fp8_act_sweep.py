"""The FP8 decode path's kernels with the activations quantized by the norm and SiLU kernels
(issue 23), on the GPU, one call:

* `--parts act`: the residual-add RMSNorm and SiLU * up at the Qwen3-4B / 0.6B widths and decode
  rows, the bf16 kernel followed by `quantize_act_1x128` against the fused kernel
  (milepost/kernels/fused_fp8_act.py) at each blocks-a-program setting (`GROUPS_PER_PROGRAM`,
  `SILU_GROUPS_PER_PROGRAM`; "rule" is the default's choice), and o_proj's input quantizer
  `quantize_act_1x128` against `quantize_rows_fp8` (8 blocks a program), each checked bit for bit
  first;
* `--parts gemm`: the decode FP8 GEMM (`decode_block_mm_quantized`, the call the engine makes
  on an Fp8Act) over benchmarks/fp8_gemm_sweep.py's focus grid, ticket and second-kernel sums,
  no programmatic dependent launch (the norm kernels do not trigger one), with the activation
  already quantized: no quantize launch in the times, unlike the table's H200 sweep. Prints the
  `fp8_decode_table.py` entries to paste.

Times are per call from CUDA graphs (fp8_gemm_sweep.graph_us; the GEMM over weights that
overflow L2).

    PYTHONPATH=$PWD python3 benchmarks/fp8_act_sweep.py --shapes qwen3-4b --ms 64,256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_gemm_sweep as sweep  # noqa: E402

from milepost.kernels import fp8_decode, fused_fp8_act, fused_ops  # noqa: E402
from milepost.kernels.fp8_decode import DecodeConfig  # noqa: E402
from milepost.kernels.fp8_quant import quantize_act_1x128  # noqa: E402

WIDTHS = {"qwen3-4b": (2560, 9728, 4096), "qwen3-0.6b": (1024, 3072, 2048)}  # hidden, intermediate,
# attention output (o_proj's input: quantized on its own)
CALLS = 32  # launches a graph: the per-call time includes the gap between kernels


def _bits(a, q: torch.Tensor, s: torch.Tensor) -> bool:
    return (torch.equal(a.values.view(torch.uint8), q.view(torch.uint8))
            and torch.equal(a.scales.view(torch.int32), s.view(torch.int32)))


def graph_us(fn) -> float:
    return sweep.graph_us([fn] * CALLS)[0]


def _settings(groups: int) -> list[int | None]:
    """None (the rule's choice) and every power of two up to the row's blocks."""
    return [None, *[g for g in (1, 2, 4, 8, 16, 32) if g < 2 * groups]]


def act_rows(shape: str, m: int, dev: str = "cuda", timer=graph_us) -> list[dict]:
    """One row per kernel and setting: us per call (`timer`), the unfused pair's first."""
    hidden, inter, attn = WIDTHS[shape]
    g = torch.Generator(device=dev).manual_seed(m)
    x = torch.randn(m, hidden, device=dev, generator=g).bfloat16()
    r = torch.randn(m, hidden, device=dev, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device=dev, generator=g)).bfloat16()
    gate_up = torch.randn(m, 2 * inter, device=dev, generator=g).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    o = torch.randn(m, attn, device=dev, generator=g).bfloat16()
    rows = []

    def pair_norm():
        return quantize_act_1x128(fused_ops.add_rms_norm(x, r, w, 1e-6)[1], 4)

    def pair_silu():
        return quantize_act_1x128(fused_ops.silu_mul(gate, up), 4)

    q_n, s_n = pair_norm()
    q_s, s_s = pair_silu()
    base = {"shape": shape, "M": m}
    rows.append({**base, "kernel": "add_rms_norm + quantize", "setting": "-", "us": timer(pair_norm)})
    for gp in _settings(hidden // 128):
        fused_fp8_act.GROUPS_PER_PROGRAM = gp
        try:
            ok = _bits(fused_fp8_act.add_rms_norm_fp8(x, r, w, 1e-6)[1], q_n, s_n)
            us = timer(lambda: fused_fp8_act.add_rms_norm_fp8(x, r, w, 1e-6)) if ok else "wrong bits"
        finally:
            fused_fp8_act.GROUPS_PER_PROGRAM = None
        rows.append({**base, "kernel": "add_rms_norm_fp8", "setting": gp or "rule", "us": us})
    rows.append({**base, "kernel": "silu_mul + quantize", "setting": "-", "us": timer(pair_silu)})
    for gp in _settings(inter // 128):
        fused_fp8_act.SILU_GROUPS_PER_PROGRAM = gp
        try:
            ok = _bits(fused_fp8_act.silu_mul_fp8(gate, up), q_s, s_s)
            us = timer(lambda: fused_fp8_act.silu_mul_fp8(gate, up)) if ok else "wrong bits"
        finally:
            fused_fp8_act.SILU_GROUPS_PER_PROGRAM = None
        rows.append({**base, "kernel": "silu_mul_fp8", "setting": gp or "rule", "us": us})
    q_o, s_o = quantize_act_1x128(o, 4)
    rows.append({**base, "kernel": "quantize_act_1x128 (o_proj)", "setting": "-",
                 "us": timer(lambda: quantize_act_1x128(o, 4))})
    for gp in _settings(attn // 128):
        fused_fp8_act.QUANT_GROUPS_PER_PROGRAM = gp
        try:
            ok = _bits(fused_fp8_act.quantize_rows_fp8(o), q_o, s_o)
            us = timer(lambda: fused_fp8_act.quantize_rows_fp8(o)) if ok else "wrong bits"
        finally:
            fused_fp8_act.QUANT_GROUPS_PER_PROGRAM = None
        rows.append({**base, "kernel": "quantize_rows_fp8", "setting": gp or "rule", "us": us})
    return rows


def gemm_row(case: sweep.Case, m: int, sms: int, deadline: float) -> dict:
    """The focus grid (no PDL) timed on a prequantized activation; the table's config among it."""
    x = torch.randn(m, case.k, device=case.wq[0].device, dtype=torch.bfloat16)
    ref = case.reference(x)
    xq, sx = quantize_act_1x128(x, 4)
    table = fp8_decode.decode_config(m, case.n, case.k, sms)
    grid: dict[str, float | str] = {}
    for cfg in focus_configs(m, case.n, case.k, sms):
        if time.time() > deadline:
            grid[str(tuple(cfg))] = "skipped: time budget"
            continue
        grid[str(tuple(cfg))] = case.time(
            lambda x, i, c=cfg: fp8_decode.decode_block_mm_quantized(
                xq, sx, m, case.wq[i], case.sw[i], torch.bfloat16, c), x, ref)
    timed = [(DecodeConfig(*eval(c)), t) for c, t in grid.items() if isinstance(t, float)]  # noqa: S307
    best = min(timed, key=lambda ct: ct[1]) if timed else None
    by_ticket = {tk: min((t for c, t in timed if c.split > 1 and c.ticket == tk), default=None)
                 for tk in (False, True)}
    return {"M": m, "N": case.n, "K": case.k, "table": list(table),
            "table_us": grid.get(str(tuple(table._replace(pdl=False)))),
            "best": list(best[0]) if best else None, "best_us": best[1] if best else None,
            "best_split_second_kernel_us": by_ticket[False], "best_split_ticket_us": by_ticket[True],
            "grid": grid}


def focus_configs(m: int, n: int, k: int, sms: int) -> list[DecodeConfig]:
    """fp8_gemm_sweep's focus grid without programmatic dependent launch, the table's config in it."""
    return sorted({c._replace(pdl=False) for c in sweep.focus_grid(m, n, k, sms)})


def precompile(shapes: list[str], ms: list[int], sms: int, workers: int, timeout: float = 120) -> None:
    """Every kernel variant the GEMM part times, compiled in `workers` processes into Triton's
    disk cache first (what is left after `timeout` compiles on first use)."""
    import multiprocessing as mp

    keys = sorted({sweep.compile_key(c, m, k) for shape in shapes for n, k in sweep.LINEARS[shape].values()
                   for m in ms for c in focus_configs(m, n, k, sms)})
    t = time.time()
    try:
        with mp.get_context("spawn").Pool(workers) as pool:
            failed = sum(pool.map_async(sweep._compile_variants, [keys[i::workers] for i in range(workers)])
                         .get(timeout))
        print(f"compiled {len(keys)} variants in {time.time() - t:.1f} s ({failed} did not compile)",
              flush=True)
    except Exception as e:  # noqa: BLE001 - the rest compile on first use
        print(f"parallel compile stopped after {time.time() - t:.1f} s ({e!r:.200})", flush=True)


def fmt(t) -> str:
    return f"{t:7.2f}" if isinstance(t, float) else f"{str(t)[:10]:>7}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--parts", default="act,gemm")
    p.add_argument("--shapes", default="qwen3-4b")
    p.add_argument("--ms", default="64,256")
    p.add_argument("--budget-s", type=float, default=300.0, help="GEMM configs past this are skipped")
    p.add_argument("--workers", type=int, default=min(15, max(1, (os.cpu_count() or 2) - 1)))
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}", flush=True)
    shapes, ms, parts = a.shapes.split(","), [int(v) for v in a.ms.split(",")], a.parts.split(",")
    out: dict = {"device": torch.cuda.get_device_name(), "act": [], "gemm": []}
    if "act" in parts:
        print("kernel                      setting | us/call", flush=True)
        for shape in shapes:
            for m in ms:
                for row in act_rows(shape, m):
                    out["act"].append(row)
                    print(f"{shape:10} M={m:<4} {row['kernel']:28} {str(row['setting']):>5} | "
                          f"{fmt(row['us'])}", flush=True)
    if "gemm" in parts:
        precompile(shapes, ms, sms, a.workers)
        deadline = t0 + a.budget_s
        print("gemm     M    | us/call: table  best  best-split(2nd kernel)  best-split(ticket) "
              "| best config", flush=True)
        for shape in shapes:
            for name, (n, k) in sweep.LINEARS[shape].items():
                case = sweep.Case(n, k, torch.device("cuda"))
                for m in ms:
                    row = {"shape": shape, "gemm": name, **gemm_row(case, m, sms, deadline)}
                    out["gemm"].append(row)
                    print(f"{shape:10} {name:7} {m:4} | {fmt(row['table_us'])} {fmt(row['best_us'])} "
                          f"{fmt(row['best_split_second_kernel_us'])} {fmt(row['best_split_ticket_us'])} "
                          f"| {row['best']}", flush=True)
                del case
                torch.cuda.empty_cache()
        print(f"\nfp8_decode_table.py entries measured on {out['device']}, activations prequantized "
              "(N, K, M bucket): (bm, bn, split, warps, stages, fused, ticket, narrow):", flush=True)
        for r in out["gemm"]:
            if r["best"]:
                print(f"    ({r['N']}, {r['K']}, {r['M']}): {tuple(r['best'][:8])},  # {r['shape']} "
                      f"{r['gemm']}: {r['best_us']:.1f} us (prequantized)")
    print(f"\nsweep took {time.time() - t0:.1f} s", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
