"""FP8 blockwise GEMMs at decode M on the GPU, one call: for each projection of the Qwen3-4B and
0.6B shapes and M in 1..256, bf16 F.linear (cuBLAS), the FP8 Triton GEMM (`triton`), cuBLAS's
block-scaled FP8 GEMM (`scaled_mm`), the decode kernel with its current config (`decode`) and
the decode kernel over a grid of configs, each checked against the emulated product first.

Every time is per call from a CUDA graph (as the engine's decode replays them) that calls the GEMM
on enough copies of the weight to overflow L2 (a model's layers do): weight bytes come from HBM.
The grid is searched in two passes (row/weight block, K split, fusion at 4 stages; then stages and
warps around the best) after compiling every variant in parallel processes (Triton's disk cache).
Prints a table, the per-layer sum, and the DECODE_TABLE entries for milepost/kernels/fp8_gemm.py.

    PYTHONPATH=$PWD python benchmarks/fp8_gemm_sweep.py --json-out fp8_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import time

import torch
import torch.nn.functional as F

from milepost.kernels import fp8_gemm as fg
from milepost.kernels.fp8_gemm import DecodeConfig

LINEARS = {  # shape -> projection -> (N, K)
    "qwen3-4b": {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}
MS = (1, 8, 16, 32, 64, 128, 256)
L2_BYTES = 96 << 20  # weights cycled per graph: about twice the H200's L2
STAGES, WARPS = (3, 4, 6), (4, 8)


def row_blocks(m: int) -> tuple[int, ...]:
    return (16,) if m <= 16 else (32,) if m <= 32 else (64,) if m <= 64 else (64, 128)


def splits(m: int, n: int, k: int, bm: int, bn: int, sms: int) -> list[int]:
    tiles = math.ceil(m / bm) * (n // bn)
    out = [s for s in (1, 2, 4, 8, 16) if s <= k // 128 and (s == 1 or tiles * s <= 4 * sms)]
    return sorted({math.ceil(k // 128 / math.ceil(k // 128 / s)) for s in out})  # splits that differ


def first_pass(m: int, n: int, k: int, sms: int) -> list[DecodeConfig]:
    return [DecodeConfig(bm, bn, s, 4 if bm * bn < 64 * 128 else 8, 4, fused, ticket, narrow)
            for bm in row_blocks(m) for bn in (32, 64, 128, 256)[: 4 if m >= 64 else 3]
            for s in splits(m, n, k, bm, bn, sms)
            for fused in (True, False) for ticket in ((False, True) if s > 1 else (False,))
            for narrow in ((False, True) if fused and m < bm else (False,))]


def focus_grid(m: int, n: int, k: int, sms: int) -> list[DecodeConfig]:
    """--focus: separate quantization only (the fused one never won), K splits up to 16 programs
    per SM (against wave quantization), with and without programmatic dependent launch, the
    table's config among them."""
    n_kb = k // 128
    out = {fg.decode_config(m, n, k, sms)}
    for bm in sorted({min(64, max(16, 1 << (m - 1).bit_length()))}):
        for bn in (32, 64, 128):
            tiles = math.ceil(m / bm) * (n // bn)
            for s in sorted({math.ceil(n_kb / math.ceil(n_kb / s)) for s in (1, 2, 3, 4, 6, 8, 12, 16)
                             if s <= n_kb and tiles * s <= 16 * sms}):
                for st in (3, 4):
                    for ticket in ((False, True) if s > 1 else (False,)):
                        for pdl in (False, True):
                            out.add(DecodeConfig(bm, bn, s, 8 if bm * bn >= 64 * 128 else 4, st, False,
                                                 ticket, False, pdl))
    return sorted(out)


def second_pass(best: DecodeConfig) -> list[DecodeConfig]:
    warps = WARPS if best.block_m * best.block_n >= 64 * 64 else (4,)
    return [best._replace(stages=st, warps=w) for st in STAGES for w in warps
            if (st, w) != (best.stages, best.warps)]


def compile_key(cfg: DecodeConfig, m: int, k: int) -> tuple:
    """What Triton compiles separately: (block_m, block_n, warps, stages, fused, mode, rows
    quantized) with mode 0: no split, 1: parts summed by a second kernel, 2: by ticket."""
    n_kb = k // 128
    split = math.ceil(n_kb / math.ceil(n_kb / cfg.split))
    mode = 0 if split == 1 else (2 if cfg.ticket else 1)
    narrow = cfg.fused and cfg.narrow and m < cfg.block_m
    return (cfg.block_m, cfg.block_n, cfg.warps, cfg.stages, cfg.fused, mode,
            1 << (m - 1).bit_length() if narrow else cfg.block_m, cfg.pdl)


def _compile_variants(keys: list[tuple]) -> int:
    """Worker: run each compile_key once on a small problem, so Triton compiles it into its disk
    cache; the number that failed to compile."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda")
    w = torch.randn(256, 512, device=dev).to(torch.float8_e4m3fn)
    sw = torch.ones(2, 4, device=dev)
    failed = 0
    for bm, bn, warps, stages, fused, mode, rows, pdl in keys:
        x = torch.randn(rows, 512, device=dev, dtype=torch.bfloat16)
        try:
            fg.decode_block_mm(x, w, sw, torch.bfloat16, DecodeConfig(
                bm, bn, 2 if mode else 1, warps, stages, fused, mode == 2, rows < bm, pdl))
        except Exception:  # noqa: BLE001 - out of shared memory etc.: the sweep reports it
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(shapes: list[str], ms: list[int], sms: int, workers: int, focus: bool,
               timeout: float = 60) -> None:
    """Compile every kernel variant the passes (or the focus grid) can run, in `workers` processes."""
    keys = set()
    for shape in shapes:
        for n, k in LINEARS[shape].values():
            for m in ms:
                if focus:
                    keys.update(compile_key(c, m, k) for c in focus_grid(m, n, k, sms))
                    continue
                for cfg in first_pass(m, n, k, sms):
                    keys.update(compile_key(c, m, k) for c in [cfg, *second_pass(cfg)])
    if focus:  # and what an engine starting next compiles: its probe, per-M timing and table configs
        for m, n, k in ((1, 384, 512), (3, 256, 640), (64, 384, 512), (200, 384, 512), (300, 256, 1024)):
            for option in ("", "ticket", "narrow"):
                keys.update(compile_key(c, m, k) for c in fg._decode_variants(m, n, k, sms, option))
        keys.update(compile_key(fg.decode_config(m, 4096, 4096, sms), m, 4096) for m in fg.DECODE_BUCKETS)
        keys.update(compile_key(c, m, k) for (n, k, m), c in fg.DECODE_TABLE.items())
    variants = sorted(keys)
    t = time.time()
    try:
        with mp.get_context("spawn").Pool(workers) as pool:  # left after `timeout`: killed
            failed = sum(pool.map_async(_compile_variants, [variants[i::workers] for i in range(workers)])
                         .get(timeout))
        print(f"compiled {len(variants)} decode-kernel variants in {time.time() - t:.1f} s "
              f"({workers} processes; {failed} did not compile)", flush=True)
    except Exception as e:  # noqa: BLE001 - the rest compile on first use
        print(f"parallel compile stopped after {time.time() - t:.1f} s ({e!r:.200}); the rest "
              "compile on first use", flush=True)


def graph_us(calls, reps: int = 0) -> tuple[float, list]:
    """Microseconds per call: `calls` (one per weight copy) captured in one graph, replayed
    until 64 calls or more are timed (`reps` times when given); and the graph's outputs."""
    reps = reps or max(3, math.ceil(64 / len(calls)))
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [c() for c in calls]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(calls), outs


class Case:
    """One (N, K) weight in `copies` copies, bf16 and fp8, and the emulated products per M."""

    def __init__(self, n: int, k: int, dev: torch.device) -> None:
        from milepost.lowprec.quantize import quantize

        w = torch.randn(n, k, device=dev) * 0.02
        q = quantize(w, "fp8_block")
        self.n, self.k = n, k
        self.copies = max(2, min(32, math.ceil(L2_BYTES / (n * k))))
        self.wb = [w.to(torch.bfloat16) for _ in range(self.copies)]
        self.wq = [q.values.clone() for _ in range(self.copies)]
        self.sw = [q.scales.clone() for _ in range(self.copies)]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx = fg.quantize_act_1x128(x)
        return fg.emulated_block_mm(xq, sx, self.wq[0], self.sw[0], torch.float32)

    def time(self, fn, x: torch.Tensor, ref: torch.Tensor | None) -> float | str:
        """fn(x, i) -> output for copy i; checked on copy 0 against `ref` (None: not checked)."""
        try:
            if ref is not None:
                out = fn(x, 0).float()
                if not fg._agrees(out, ref):
                    return f"wrong (max diff {(out - ref).abs().max().item():.3g})"
            us, outs = graph_us([lambda i=i: fn(x, i) for i in range(self.copies)])
            if ref is not None and not fg._agrees(outs[0].float(), ref):  # as replayed, too
                return f"wrong in the graph (max diff {(outs[0].float() - ref).abs().max().item():.3g})"
            return us
        except Exception as e:  # noqa: BLE001 - report, go on
            return f"failed: {str(e).splitlines()[0][:100]}"


def sweep_case(case: Case, m: int, sms: int, deadline: float, focus: bool = False) -> dict:
    dev = case.wq[0].device
    x = torch.randn(m, case.k, device=dev, dtype=torch.bfloat16)
    ref = case.reference(x)
    row = {"M": m, "N": case.n, "K": case.k, "copies": case.copies,
           "bf16": case.time(lambda x, i: F.linear(x, case.wb[i]), x, None)}
    for name in ("decode",) if focus else ("triton", "scaled_mm", "decode"):
        row[name] = case.time(lambda x, i, b=name: fg.fp8_block_linear(x, case.wq[i], case.sw[i], b), x, ref)
    row["decode_config"] = list(fg.decode_config(m, case.n, case.k, sms))
    grid: dict[str, float | str] = {}

    def run(cfgs: list[DecodeConfig]) -> None:
        for cfg in cfgs:
            if time.time() > deadline:
                grid[str(tuple(cfg))] = "skipped: time budget"
                continue
            grid[str(tuple(cfg))] = case.time(
                lambda x, i, c=cfg: fg.decode_block_mm(x, case.wq[i], case.sw[i], torch.bfloat16, c), x, ref)

    def best() -> tuple[DecodeConfig, float] | None:
        timed = [(DecodeConfig(*eval(c)), t) for c, t in grid.items() if isinstance(t, float)]  # noqa: S307
        return min(timed, key=lambda ct: ct[1]) if timed else None

    if focus:
        run(focus_grid(m, case.n, case.k, sms))
        b = best()
    else:
        run(first_pass(m, case.n, case.k, sms))
        b = best()
        if b is not None:
            run(second_pass(b[0]))
            b = best()
    row["grid"] = grid
    row["best"] = list(b[0]) if b else None
    row["best_us"] = b[1] if b else None
    return row


def fmt(t) -> str:
    return f"{t:7.1f}" if isinstance(t, float) else f"{str(t)[:7]:>7}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="qwen3-4b,qwen3-0.6b")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--budget-s", type=float, default=90.0, help="grid configs past this are skipped")
    p.add_argument("--workers", type=int, default=min(15, max(1, (os.cpu_count() or 2) - 1)))
    p.add_argument("--focus", action="store_true",
                   help="one pass over focus_grid (no fused configs, more K splits); decode and bf16 only")
    p.add_argument("--json-out", default=None)
    a = p.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}", flush=True)
    precompile(a.shapes.split(","), [int(v) for v in a.ms.split(",")], sms, a.workers, a.focus)
    deadline = t0 + a.budget_s
    rows = []
    ms = [int(v) for v in a.ms.split(",")]
    print(f"{'shape':10} {'gemm':7} {'M':>4} | us/call: {'bf16':>7} {'triton':>7} {'scl_mm':>7} "
          f"{'decode':>7} {'best':>7} | best/bf16 | best config (bm, bn, split, warps, stages, fused, ticket, narrow, pdl)")
    for shape in a.shapes.split(","):
        for name, (n, k) in LINEARS[shape].items():
            case = Case(n, k, dev)
            for m in ms:
                row = {"shape": shape, "gemm": name, **sweep_case(case, m, sms, deadline, a.focus)}
                rows.append(row)
                ratio = (row["bf16"] / row["best_us"]) if row["best_us"] and isinstance(row["bf16"], float) else None
                print(f"{shape:10} {name:7} {m:4} | {'':8} {fmt(row['bf16'])} {fmt(row.get('triton', '-'))} "
                      f"{fmt(row.get('scaled_mm', '-'))} {fmt(row['decode'])} {fmt(row['best_us'])} | "
                      f"{f'{ratio:.2f}x' if ratio else '-':>9} | {row['best']}", flush=True)
            del case
            torch.cuda.empty_cache()
    print("\nper layer (sum over the projections), us: bf16 | best fp8 | ratio", flush=True)
    for shape in a.shapes.split(","):
        for m in ms:
            sel = [r for r in rows if r["shape"] == shape and r["M"] == m]
            if all(isinstance(r["bf16"], float) and r["best_us"] for r in sel):
                b16, f8 = sum(r["bf16"] for r in sel), sum(r["best_us"] for r in sel)
                print(f"{shape:10} M={m:4}: {b16:8.1f} | {f8:8.1f} | {b16 / f8:.2f}x")
    print("\nDECODE_TABLE entries (N, K, M bucket): DecodeConfig(...):", flush=True)
    for r in rows:
        if r["best"]:
            print(f"    ({r['N']}, {r['K']}, {r['M']}): DecodeConfig{tuple(r['best'])},  "
                  f"# {r['shape']} {r['gemm']} {r['best_us']:.1f} us, bf16 {fmt(r['bf16']).strip()} us")
    print(f"\nsweep took {time.time() - t0:.1f} s", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
