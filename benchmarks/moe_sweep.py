"""Fused Triton MoE (milepost/kernels/fused_moe.py) against today's grouped GEMMs on the 30B-A3B
expert shape, over a grid of tile configs, all timed as CUDA-graph replays; one GPU call.

Shape: hidden 2048, moe_intermediate 768, 128 experts, top-8, bf16 random weights, routing from
random logits (softmax, top-k, renormalized). `--layers` distinct weight sets are cycled so the
weights come from HBM, not L2 (as in a decode step over 48 layers). Kernels are compiled first in
a pool of processes (Triton's disk cache), so the timed process only loads them. Prints a table per
token count T, the best config, the fraction of the bandwidth bound (bytes of the experts touched
+ activations / time / --peak-bandwidth) and the error against an fp32 per-expert loop; --json-out.

Usage: PYTHONPATH=$PWD python benchmarks/moe_sweep.py --json-out moe_sweep.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import asdict

import torch

E, H, I, K = 128, 2048, 768, 8
DTYPE = torch.bfloat16
BLOCK_MS = (16, 32, 64, 128)
# (block_n, block_k, num_warps, num_stages[, swap_ab]); paired by index for the compile jobs
GATE_UP = ((32, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4),
           (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 4, 3), (128, 128, 8, 3), (64, 256, 4, 2),
           (64, 128, 4, 3, True), (128, 64, 4, 4, True), (128, 128, 4, 3, True))
DOWN = ((32, 128, 4, 4), (64, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4),
        (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3),
        (64, 128, 4, 3, True), (128, 64, 4, 4, True), (128, 128, 4, 3, True))


def _gemm(c: tuple) -> "object":
    from milepost.kernels.fused_moe import GemmConfig

    return GemmConfig(c[0], c[1], c[2], c[3], 8, len(c) > 4 and c[4])


def _compile_job(job: tuple[int, list[tuple]]) -> tuple[int, float]:
    """Runs each (block_m, gate_up, down) once at 64 tokens: fills Triton's disk cache."""
    from milepost.kernels import fused_moe as fm

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    w13 = torch.zeros(E, 2 * I, H, device=dev, dtype=torch.bfloat16)
    w2 = torch.zeros(E, H, I, device=dev, dtype=torch.bfloat16)
    for bm, gu, dn in job[1]:
        cfg = fm.MoeConfig(bm, _gemm(gu), _gemm(dn))
        x = torch.zeros(64, H, device=dev, dtype=torch.bfloat16)
        ids = torch.randint(0, E, (64, K), device=dev)
        routing = fm.align(ids, E, bm)
        try:
            fm.align(ids, E, bm, hist=True)
        except Exception as e:  # noqa: BLE001
            print(f"compile m{bm} align hist: {type(e).__name__}", flush=True)
        try:  # each kernel on its own: a tile over the shared-memory limit fails alone
            fm.gate_up(x, w13, routing, K, bm, _gemm(gu))
        except Exception as e:  # noqa: BLE001 - reported by the timed run
            print(f"compile m{bm} gate_up {gu}: {type(e).__name__}", flush=True)
        try:
            act = torch.zeros(routing[0].numel(), I, device=dev, dtype=torch.bfloat16)
            fm.down(act, w2, routing, torch.ones(64, K, device=dev, dtype=torch.bfloat16), bm, _gemm(dn))
        except Exception as e:  # noqa: BLE001
            print(f"compile m{bm} down {dn}: {type(e).__name__}", flush=True)
        fm.combine(torch.zeros(64 * K, H, device=dev, dtype=torch.bfloat16), 64, K)
    torch.cuda.synchronize()
    return job[0], time.perf_counter() - t0


def precompile(workers: int) -> float:
    jobs = [(bm, gu, dn) for bm in BLOCK_MS for gu, dn in zip(GATE_UP, DOWN)]
    parts = [(i, jobs[i::workers]) for i in range(workers)]
    t0 = time.perf_counter()
    try:
        with mp.get_context("spawn").Pool(workers) as pool:
            pool.map(_compile_job, parts)
    except Exception as e:  # noqa: BLE001 - the timed process then compiles each config itself
        print(f"precompile failed ({type(e).__name__}: {e}); compiling in the timed process", flush=True)
    return time.perf_counter() - t0


def graph_ms(fn, reps: int) -> float:
    """Median over reps of one replay of a graph that runs fn once (ms); inf when fn cannot run
    (a tile over the device's shared memory: raised by the eager warm-up, before any capture)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - Triton's OutOfResources and kin
        print(f"      skipped: {type(e).__name__}: {str(e)[:100]}", flush=True)
        return float("inf")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    return sorted(times)[len(times) // 2]


def loop_reference(x, ids, w, w13, w2) -> torch.Tensor:
    """fp32 per-expert loop over the bf16 weights."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        tok = pairs // K
        g, u = (x[tok].float() @ w13[e].float().T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u) @ w2[e].float().T
        out.index_add_(0, tok, y * w.reshape(-1)[pairs].float()[:, None])
    return out


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def sweep_block_m(bm: int, xs: list, routing: list, w13s: list, w2s: list, grouped0: torch.Tensor,
                  time_fn, reps: int) -> dict:
    """Every gate_up and down tile at one BLOCK_M, each kernel timed alone; then the fused path with
    the best of each (and the faster align), checked against the grouped result of layer 0."""
    from milepost.kernels import fused_moe as fm

    L = len(xs)
    al = [fm.align(routing[i][0], E, bm) for i in range(L)]
    align_ms, hist_ms = (time_fn(lambda: [fm.align(routing[i][0], E, bm, h) for i in range(L)], reps)
                         for h in (False, True))
    gu_us, dn_us = {}, {}
    for c in GATE_UP:
        cfg = _gemm(c)
        gu_us[c] = time_fn(lambda: [fm.gate_up(xs[i], w13s[i], al[i], K, bm, cfg) for i in range(L)],
                           reps) / L * 1e3
    acts = [fm.gate_up(xs[i], w13s[i], al[i], K, bm, _gemm(GATE_UP[0])) for i in range(L)]
    for c in DOWN:
        cfg = _gemm(c)
        dn_us[c] = time_fn(lambda: [fm.down(acts[i], w2s[i], al[i], routing[i][1], bm, cfg)
                                    for i in range(L)], reps) / L * 1e3
    cfg = fm.MoeConfig(bm, _gemm(min(gu_us, key=gu_us.get)), _gemm(min(dn_us, key=dn_us.get)),
                       hist_align=hist_ms < align_ms)
    fused_ms = time_fn(lambda: [fm.fused_expert_mlp(xs[i], *routing[i], w13s[i], w2s[i], cfg)
                                for i in range(L)], reps)
    got = fm.fused_expert_mlp(xs[0], *routing[0], w13s[0], w2s[0], cfg)
    return {"align_us": align_ms / L * 1e3, "align_hist_us": hist_ms / L * 1e3,
            "fused_us": fused_ms / L * 1e3, "fused_ms_all": fused_ms,
            "gate_up_us": {str(c): v for c, v in gu_us.items()},
            "down_us": {str(c): v for c, v in dn_us.items()},
            "vs_grouped": rel(got, grouped0.float()), "config": asdict(cfg), "label": cfg.label(), "cfg": cfg}


def sweep_tokens(t: int, w13s: list, w2s: list, args: argparse.Namespace) -> dict:
    """Every config at T tokens; the best one checked against the loop and the grouped path."""
    from milepost.kernels import fused_moe as fm
    from milepost.kernels.grouped_experts import grouped_expert_mlp

    dev, L, reps = w13s[0].device, len(w13s), args.reps
    time_fn = graph_ms if dev.type == "cuda" else wall_ms
    xs = [torch.randn(t, H, device=dev, dtype=DTYPE) for _ in range(L)]
    routing = []
    for _ in range(L):
        probs = torch.softmax(torch.randn(t, E, device=dev), dim=-1)
        w, ids = torch.topk(probs, K, dim=-1)
        routing.append((ids, (w / w.sum(-1, keepdim=True)).to(DTYPE)))
    touched = sum(r[0].unique().numel() for r in routing) / L
    nbytes = touched * 3 * H * I * 2 + 2 * t * H * 2 + t * K * 10  # experts, x in + out, routing

    def frac(ms: float) -> float:
        return nbytes / (ms / L * 1e-3) / args.peak_bandwidth

    grouped_ms = time_fn(lambda: [grouped_expert_mlp(xs[i], *routing[i], w13s[i], w2s[i])
                                  for i in range(L)], reps)
    grouped = grouped_expert_mlp(xs[0], *routing[0], w13s[0], w2s[0])
    ref = loop_reference(xs[0], *routing[0], w13s[0], w2s[0])
    row = {"tokens": t, "experts_touched": touched, "bytes_per_layer": nbytes,
           "grouped_us": grouped_ms / L * 1e3, "grouped_bw_frac": frac(grouped_ms),
           "rel_err_grouped": rel(grouped, ref), "per_bm": {}}
    best = None
    # a 128-row block is mostly padding at decode sizes; 16 rows is a slow tile for prefill
    for bm in [b for b in BLOCK_MS if len(BLOCK_MS) == 1 or (b <= 64 if t <= 256 else b >= 32)]:
        try:
            r = sweep_block_m(bm, xs, routing, w13s, w2s, grouped, time_fn, reps)
        except Exception:  # noqa: BLE001 - the other block sizes still run; the trace says why
            traceback.print_exc()
            continue
        cfg = r.pop("cfg")
        row["per_bm"][bm] = r
        if r["vs_grouped"] < 2e-2 and (best is None or r["fused_ms_all"] < best[0]):
            best = (r["fused_ms_all"], cfg)
    if best is None:
        print(f"T={t}: no fused config ran correctly", flush=True)
        row.update(fused_us=None, best=None)
        return row
    fused_ms, cfg = best
    got = fm.fused_expert_mlp(xs[0], *routing[0], w13s[0], w2s[0], cfg)
    again = fm.fused_expert_mlp(xs[0], *routing[0], w13s[0], w2s[0], cfg)
    row.update(fused_us=fused_ms / L * 1e3, fused_bw_frac=frac(fused_ms), best=asdict(cfg),
               best_label=cfg.label(), speedup=grouped_ms / fused_ms, rel_err_fused=rel(got, ref),
               fused_vs_grouped=rel(got, grouped.float()), deterministic=bool(torch.equal(got, again)))
    return row


def report(row: dict) -> None:
    if row["fused_us"] is None:
        print(f"T={row['tokens']:5d} grouped {row['grouped_us']:8.1f} us; fused: none ran", flush=True)
        return
    print(f"T={row['tokens']:5d} experts/layer {row['experts_touched']:6.1f}  grouped {row['grouped_us']:8.1f} us"
          f" ({row['grouped_bw_frac']:.0%})  fused {row['fused_us']:8.1f} us ({row['fused_bw_frac']:.0%})"
          f"  x{row['speedup']:.2f}  err vs fp32 loop: fused {row['rel_err_fused']:.2e} grouped "
          f"{row['rel_err_grouped']:.2e}  deterministic {row['deterministic']}", flush=True)
    for bm, r in row["per_bm"].items():
        gu, dn = min(r["gate_up_us"].values()), min(r["down_us"].values())
        print(f"    m{bm:<4d} align {r['align_us']:6.1f} (hist {r['align_hist_us']:.1f})  gate_up {gu:7.1f}"
              f"  down {dn:7.1f}  fused {r['fused_us']:7.1f} us  vs grouped {r['vs_grouped']:.1e}  {r['label']}",
              flush=True)


def _cfg_repr(d: dict) -> str:
    from milepost.kernels import fused_moe as fm

    return repr(fm.MoeConfig(d["block_m"], fm.GemmConfig(**d["gate_up"]), fm.GemmConfig(**d["down"]),
                             d["hist_align"]))


def wall_ms(fn, reps: int) -> float:
    """CPU (--cpu-check): one timed call, to exercise the script's logic under Triton's interpreter."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    global E, H, I, K, BLOCK_MS, GATE_UP, DOWN, DTYPE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,16,64,128,256,1024,2048,4096")
    ap.add_argument("--layers", type=int, default=4, help="distinct weight sets cycled per replay")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--peak-bandwidth", type=float, default=4.8e12)
    ap.add_argument("--json-out", default="")
    ap.add_argument("--cpu-check", action="store_true",
                    help="tiny shape on CPU under TRITON_INTERPRET=1: checks the script, times nothing real")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.cpu_check:
        E, H, I, K = 8, 32, 32, 2
        DTYPE = torch.float32  # the interpreter's bf16 tl.dot is wrong (triton 3.9)
        BLOCK_MS, GATE_UP, DOWN = (16,), ((16, 16, 4, 1), (16, 16, 4, 1, True)), ((16, 16, 4, 1),) * 2
        dev, compile_s, name = torch.device("cpu"), 0.0, "cpu"
        args.tokens, args.layers = "1,5", 2
    else:
        compile_s = precompile(args.workers)
        dev, name = torch.device("cuda"), torch.cuda.get_device_name()
    print(f"device {name}, torch {torch.__version__}, precompiled {len(BLOCK_MS) * len(GATE_UP)} "
          f"configs in {compile_s:.1f} s", flush=True)
    torch.manual_seed(0)
    w13s = [torch.randn(E, 2 * I, H, device=dev, dtype=DTYPE) * 0.02 for _ in range(args.layers)]
    w2s = [torch.randn(E, H, I, device=dev, dtype=DTYPE) * 0.02 for _ in range(args.layers)]
    results = []
    with torch.inference_mode():
        for t in [int(v) for v in args.tokens.split(",")]:
            row = sweep_tokens(t, w13s, w2s, args)
            results.append(row)
            report(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    print("best per T:")
    for r in results:
        if r["fused_us"] is None:
            continue
        print(f"  T={r['tokens']:5d}: {r['best_label']}  fused {r['fused_us']:.1f} us vs grouped "
              f"{r['grouped_us']:.1f} us (x{r['speedup']:.2f}), bandwidth {r['fused_bw_frac']:.0%}; "
              f"48 MoE layers {48 * r['fused_us'] / 1e3:.2f} ms vs {48 * r['grouped_us'] / 1e3:.2f} ms")
    print("table for kernels/fused_moe.py MEASURED (None where the fused path was not >= 2% faster):")
    print(f"    ({E}, {H}, {I}, {K}): (")
    for r in results:
        faster = r["fused_us"] is not None and r["speedup"] >= 1.02
        print(f"        ({r['tokens']}, {_cfg_repr(r['best']) if faster else None}),")
    print("    ),")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": name, "torch": torch.__version__,
                       "shape": {"experts": E, "hidden": H, "intermediate": I, "top_k": K},
                       "layers": args.layers, "compile_s": compile_s, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
