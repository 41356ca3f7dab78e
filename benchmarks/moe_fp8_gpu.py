"""FP8 MoE experts on the GPU (`--quantization fp8_block`, issue 23), one call per part:

  kernel: the Qwen3-30B-A3B expert shape (128 experts, hidden 2048, moe_intermediate 768, top-8),
          random bf16 weights quantized by the engine's own store (lowprec/engine_experts.py):
          the fused FP8 kernels (kernels/fused_moe_fp8.py) against an fp32 loop over the
          dequantized weights, bitwise reproducibility, and per token count T the bf16 fused path
          (its measured config) vs the FP8 path over a small grid of tiles, each kernel timed
          alone as CUDA-graph replays with `--layers` weight sets cycled (weights from HBM).
          Prints the best FP8 config per T as a MEASURED_FP8 table.
  prescale: per T, the committed W8A16 config (and it with the other swap_ab) with the product
          scaled per K step against the weight tile prescaled (kernels/fused_moe_fp8.py
          PRESCALE_FROM_TOKENS), and whether the prescaled output is the bf16 kernels' on the
          dequantized bf16 weights, bit for bit.
  engine: `milepost bench engine --shape qwen3-30b-a3b` (fixed: 256 requests x (128 + 256),
          routed experts recorded) with bf16 weights, then with --quantization fp8_block, in this
          process one after the other; tok/s, decode step ms, and the ratio. Modes: bf16,
          fp8_block, fp8_block_a8 (--fp8-w8a8-experts), fp8_block_prescale (W8A16 prescaled at
          every T).

Usage: PYTHONPATH=$PWD python benchmarks/moe_fp8_gpu.py --parts kernel --json-out k.json
       PYTHONPATH=$PWD python benchmarks/moe_fp8_gpu.py --parts engine --json-out e.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_sweep import graph_ms, wall_ms  # noqa: E402 - beside this file

E, H, I, K = 128, 2048, 768, 8
DT = torch.bfloat16
DEV = "cuda"
# (block_n, block_k, num_warps, num_stages[, swap_ab]); BLOCK_K divides the 128-wide scale block
# (swap_ab: the converted weight tile is the MMA's register operand, no trip through shared memory)
GATE_UP = ((32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4),
           (64, 64, 4, 4), (64, 128, 4, 3, True), (64, 128, 4, 4, True), (128, 128, 4, 3, True),
           (128, 128, 8, 3, True), (128, 64, 4, 4, True))
DOWN = ((64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4), (256, 64, 8, 3),
        (128, 64, 4, 4), (64, 128, 4, 3, True), (64, 128, 4, 4, True), (128, 128, 4, 3, True),
        (128, 128, 8, 3, True), (128, 64, 4, 4, True))
BLOCK_M_OF = {1: (16,), 16: (16,), 64: (16,), 128: (16, 32), 256: (16, 32), 1024: (64,), 4096: (128,)}


def _gemm(c: tuple):
    from milepost.kernels.fused_moe import GemmConfig

    return GemmConfig(c[0], c[1], c[2], c[3], 8, len(c) > 4 and c[4])


def fp8_experts(seed: int):
    """A StackedExperts on the GPU with random bf16 weights, converted by the engine's store."""
    from milepost.lowprec.engine_experts import _convert
    from milepost.models.qwen3_moe import StackedExperts

    torch.manual_seed(seed)
    with torch.inference_mode(False), torch.no_grad():  # as the engine builds them: normal tensors
        with torch.device(DEV):
            mod = StackedExperts(E, H, I).to(DT)
        mod.w13.normal_(0, 0.02)
        mod.w2.normal_(0, 0.02)
        bf16 = (mod.w13.detach().clone(), mod.w2.detach().clone())
        _convert(mod)
    return mod, bf16


def _compile_job(job: list[tuple]) -> float:
    from milepost.kernels import fused_moe_fp8 as f8

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    w13 = torch.zeros(E, 2 * I, H, device=dev, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(E, H, I, device=dev, dtype=torch.float8_e4m3fn)
    s13 = torch.ones(E, 2, I // 128, H // 128, device=dev)
    s2 = torch.ones(E, H // 128, I // 128, device=dev)
    x = torch.zeros(64, H, device=dev, dtype=DT)
    ids = torch.randint(0, E, (64, K), device=dev)
    for bm, gu, dn in job:
        routing = f8.fm.align(ids, E, bm, hist=True)
        try:
            f8.gate_up(x, w13, s13, routing, K, bm, _gemm(gu))
        except Exception as e:  # noqa: BLE001 - reported by the timed run
            print(f"compile m{bm} gate_up {gu}: {type(e).__name__}", flush=True)
        try:
            act = torch.zeros(routing[0].numel(), I, device=dev, dtype=DT)
            f8.down(act, w2, s2, routing, torch.ones(64, K, device=dev, dtype=DT), bm, _gemm(dn))
        except Exception as e:  # noqa: BLE001
            print(f"compile m{bm} down {dn}: {type(e).__name__}", flush=True)
        try:  # the experimental W8A8 kernels
            f8.gate_up_a8(x, w13, s13, routing, K, bm, _gemm(gu))
            f8.down_a8(act, w2, s2, routing, torch.ones(64, K, device=dev, dtype=DT), bm, _gemm(dn))
        except Exception as e:  # noqa: BLE001
            print(f"compile m{bm} a8 {gu} {dn}: {type(e).__name__}", flush=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def precompile(tokens: list[int], workers: int) -> float:
    bms = sorted({bm for t in tokens for bm in BLOCK_M_OF.get(t, (16,))})
    jobs = [(bm, gu, dn) for bm in bms for gu, dn in zip(GATE_UP, DOWN)]
    t0 = time.perf_counter()
    try:
        with mp.get_context("spawn").Pool(workers) as pool:
            pool.map(_compile_job, [jobs[i::workers] for i in range(workers)])
    except Exception as e:  # noqa: BLE001 - the timed process compiles each config itself
        print(f"precompile failed ({type(e).__name__}: {e})", flush=True)
    return time.perf_counter() - t0


def reference(x, ids, w, w13, w2) -> torch.Tensor:
    """fp32 per-expert loop (w13 / w2 float32: the dequantized weights)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        tok = pairs // K
        g, u = (x[tok].float() @ w13[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u) @ w2[e].T
        out.index_add_(0, tok, y * w.reshape(-1)[pairs].float()[:, None])
    return out


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def kernel_part(args: argparse.Namespace) -> dict:
    from milepost.kernels import fused_moe as fm
    from milepost.kernels import fused_moe_fp8 as f8
    from milepost.lowprec.quantize import quantize

    tokens = [int(v) for v in args.tokens.split(",")]
    compile_s = precompile(tokens, args.workers) if DEV == "cuda" else 0.0
    print(f"precompiled FP8 configs in {compile_s:.1f} s", flush=True)
    sets = [fp8_experts(i) for i in range(args.layers)]
    mod0, (w13_bf16, w2_bf16) = sets[0]
    out: dict = {"compile_s": compile_s, "rows": []}
    # The store's batched conversion is the per-tensor quantizer, bit for bit.
    exact = True
    for e, which in ((0, 0), (5 % E, 1), (E - 1, 2)):
        src = w2_bf16[e] if which == 2 else w13_bf16[e, which * I:(which + 1) * I]
        q, held = quantize(src, "fp8_block"), mod0.qtensor(e, which)
        exact &= torch.equal(q.values.view(torch.uint8), held.values.view(torch.uint8))
        exact &= torch.equal(q.scales, held.scales)
    out["store_equals_quantizer"] = bool(exact)
    print(f"engine store == per-tensor quantizer (bits): {exact}", flush=True)
    w13_deq, w2_deq = mod0.dequantize_w13(), mod0.dequantize_w2()
    L = len(sets)
    fp8w = [(m.w13.detach(), m.w13_scale, m.w2.detach(), m.w2_scale) for m, _ in sets]
    bfw = [b for _, b in sets]
    for t in tokens:
        xs = [torch.randn(t, H, device=DEV, dtype=DT) for _ in range(L)]
        routing = []
        for _ in range(L):
            w, ids = torch.topk(torch.softmax(torch.randn(t, E, device=DEV), -1), K, dim=-1)
            routing.append((ids, (w / w.sum(-1, keepdim=True)).to(DT)))
        touched = sum(r[0].unique().numel() for r in routing) / L
        row: dict = {"tokens": t, "experts_touched": touched}
        bytes_bf16 = touched * 3 * H * I * 2 + 2 * t * H * 2
        bytes_fp8 = touched * 3 * H * I * 1 + 2 * t * H * 2
        bf_cfg = fm.config_for(t, E, H, I, K)
        if bf_cfg is not None:
            ms = graph_ms(lambda: [fm.fused_expert_mlp(xs[i], *routing[i], *bfw[i], bf_cfg) for i in range(L)],
                          args.reps)
            row["bf16_fused_us"] = ms / L * 1e3
        default = f8.config_for(t, E, H, I, K)
        ms = graph_ms(lambda: [f8.fused_expert_mlp_fp8(xs[i], *routing[i], *fp8w[i], default) for i in range(L)],
                      args.reps)
        row["fp8_default_us"], row["fp8_default"] = ms / L * 1e3, default.label()
        best = (ms, default)
        best_a8 = None
        for bm in BLOCK_M_OF.get(t, (16,)):
            try:  # the experimental W8A8 kernels (activation quantization launches included)
                al = [fm.align(routing[i][0], E, bm, True) for i in range(L)]
                gu8 = {c: graph_ms(lambda c=c: [f8.gate_up_a8(xs[i], fp8w[i][0], fp8w[i][1], al[i], K, bm,
                                                              _gemm(c)) for i in range(L)], args.reps)
                       for c in GATE_UP}
                acts = [f8.gate_up(xs[i], fp8w[i][0], fp8w[i][1], al[i], K, bm, _gemm(GATE_UP[1]))
                        for i in range(L)]
                dn8 = {c: graph_ms(lambda c=c: [f8.down_a8(acts[i], fp8w[i][2], fp8w[i][3], al[i],
                                                           routing[i][1], bm, _gemm(c)) for i in range(L)],
                                   args.reps) for c in DOWN}
                cfg8 = fm.MoeConfig(bm, _gemm(min(gu8, key=gu8.get)), _gemm(min(dn8, key=dn8.get)), True)
                ms8 = graph_ms(lambda: [f8.fused_expert_mlp_fp8(xs[i], *routing[i], *fp8w[i], cfg8, True)
                                        for i in range(L)], args.reps)
                row[f"a8_m{bm}"] = {"gate_up_us": {str(c): v / L * 1e3 for c, v in gu8.items()},
                                    "down_us": {str(c): v / L * 1e3 for c, v in dn8.items()},
                                    "fused_us": ms8 / L * 1e3, "label": cfg8.label()}
                if best_a8 is None or ms8 < best_a8[0]:
                    best_a8 = (ms8, cfg8)
            except Exception:  # noqa: BLE001 - the W8A16 sweep still runs
                traceback.print_exc()
            try:
                al = [fm.align(routing[i][0], E, bm, True) for i in range(L)]
                gu = {c: graph_ms(lambda c=c: [f8.gate_up(xs[i], fp8w[i][0], fp8w[i][1], al[i], K, bm, _gemm(c))
                                               for i in range(L)], args.reps) for c in GATE_UP}
                acts = [f8.gate_up(xs[i], fp8w[i][0], fp8w[i][1], al[i], K, bm, _gemm(GATE_UP[1]))
                        for i in range(L)]
                dn = {c: graph_ms(lambda c=c: [f8.down(acts[i], fp8w[i][2], fp8w[i][3], al[i], routing[i][1],
                                                       bm, _gemm(c)) for i in range(L)], args.reps)
                      for c in DOWN}
                cfg = fm.MoeConfig(bm, _gemm(min(gu, key=gu.get)), _gemm(min(dn, key=dn.get)), True)
                ms = graph_ms(lambda: [f8.fused_expert_mlp_fp8(xs[i], *routing[i], *fp8w[i], cfg)
                                       for i in range(L)], args.reps)
                row[f"m{bm}"] = {"gate_up_us": {str(c): v / L * 1e3 for c, v in gu.items()},
                                 "down_us": {str(c): v / L * 1e3 for c, v in dn.items()},
                                 "fused_us": ms / L * 1e3, "label": cfg.label()}
                if ms < best[0]:
                    best = (ms, cfg)
            except Exception:  # noqa: BLE001 - the other block sizes still run
                traceback.print_exc()
        ms, cfg = best
        got = f8.fused_expert_mlp_fp8(xs[0], *routing[0], *fp8w[0], cfg)
        again = f8.fused_expert_mlp_fp8(xs[0], *routing[0], *fp8w[0], cfg)
        ref = reference(xs[0], *routing[0], w13_deq, w2_deq)
        ref_bf16 = reference(xs[0], *routing[0], w13_bf16.float(), w2_bf16.float())
        row.update(fp8_best_us=ms / L * 1e3, fp8_best=cfg.label(), fp8_best_cfg=repr(cfg),
                   fp8_best_dict=asdict(cfg),
                   rel_err_vs_dequant_ref=rel(got, ref), rel_err_vs_bf16_weights=rel(got, ref_bf16),
                   deterministic=bool(torch.equal(got, again)),
                   fp8_bw_frac=bytes_fp8 / (ms / L * 1e-3) / args.peak_bandwidth)
        if best_a8 is not None:
            got8 = f8.fused_expert_mlp_fp8(xs[0], *routing[0], *fp8w[0], best_a8[1], True)
            row.update(a8_best_us=best_a8[0] / L * 1e3, a8_best=best_a8[1].label(),
                       a8_rel_err_vs_dequant_ref=rel(got8, ref), a8_rel_err_vs_bf16_weights=rel(got8, ref_bf16),
                       a8_deterministic=bool(torch.equal(got8, f8.fused_expert_mlp_fp8(
                           xs[0], *routing[0], *fp8w[0], best_a8[1], True))))
            print(f"T={t:5d} W8A8: best {row['a8_best_us']:7.1f} us vs W8A16 "
                  f"{ms / L * 1e3:7.1f} us; err vs the dequantized-weight ref {row['a8_rel_err_vs_dequant_ref']:.2e}, "
                  f"vs the bf16 weights {row['a8_rel_err_vs_bf16_weights']:.2e}; {row['a8_best']}", flush=True)
        if "bf16_fused_us" in row:
            row["bf16_bw_frac"] = bytes_bf16 / (row["bf16_fused_us"] * 1e-6) / args.peak_bandwidth
            row["fp8_speedup"] = row["bf16_fused_us"] / row["fp8_best_us"]
            bf = fm.fused_expert_mlp(xs[0], *routing[0], *bfw[0], bf_cfg)
            row["bf16_rel_err_vs_its_ref"] = rel(bf, ref_bf16)
        out["rows"].append(row)
        print(f"T={t:5d} experts/layer {touched:5.1f}  bf16 fused {row.get('bf16_fused_us', float('nan')):7.1f} us"
              f" ({row.get('bf16_bw_frac', 0):.0%})  fp8 default {row['fp8_default_us']:7.1f} us  fp8 best "
              f"{row['fp8_best_us']:7.1f} us ({row['fp8_bw_frac']:.0%} of the fp8 bound)  "
              f"x{row.get('fp8_speedup', float('nan')):.2f}  err vs dequantized fp32 ref "
              f"{row['rel_err_vs_dequant_ref']:.2e} (bf16 path vs its ref {row.get('bf16_rel_err_vs_its_ref', 0):.2e});"
              f" vs the bf16 weights {row['rel_err_vs_bf16_weights']:.2e}; deterministic {row['deterministic']}"
              f"\n        best {row['fp8_best']}", flush=True)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    for r in out["rows"]:
        if "fp8_speedup" in r:
            print(f"  T={r['tokens']:5d}: 48 MoE layers bf16 {48 * r['bf16_fused_us'] / 1e3:.2f} ms, "
                  f"fp8 {48 * r['fp8_best_us'] / 1e3:.2f} ms (x{r['fp8_speedup']:.2f}), W8A8 "
                  f"{48 * r.get('a8_best_us', float('nan')) / 1e3:.2f} ms", flush=True)
    print("table for kernels/fused_moe_fp8.py MEASURED_FP8:")
    print(f"    ({E}, {H}, {I}, {K}): (")
    for r in out["rows"]:
        print(f"        ({r['tokens']}, {r['fp8_best_cfg']}),")
    print("    ),")
    return out


def prescale_part(args: argparse.Namespace) -> dict:
    from dataclasses import replace

    from milepost.kernels import fused_moe as fm
    from milepost.kernels import fused_moe_fp8 as f8

    sets = [fp8_experts(i) for i in range(args.layers)]
    L = len(sets)
    fp8w = [(m.w13.detach(), m.w13_scale, m.w2.detach(), m.w2_scale) for m, _ in sets]
    deq = [(m.dequantize_w13().to(DT).contiguous(), m.dequantize_w2().to(DT).contiguous()) for m, _ in sets]
    out: dict = {"rows": []}
    for t in [int(v) for v in args.tokens.split(",")]:
        xs = [torch.randn(t, H, device=DEV, dtype=DT) for _ in range(L)]
        routing = []
        for _ in range(L):
            w, ids = torch.topk(torch.softmax(torch.randn(t, E, device=DEV), -1), K, dim=-1)
            routing.append((ids, (w / w.sum(-1, keepdim=True)).to(DT)))
        base = f8.config_for(t, E, H, I, K)
        flip = replace(base, gate_up=replace(base.gate_up, swap_ab=not base.gate_up.swap_ab),
                       down=replace(base.down, swap_ab=not base.down.swap_ab))
        row: dict = {"tokens": t}
        for name, cfg in (("committed", base), ("swap flipped", flip)):
            times = {pre: graph_ms(lambda pre=pre: [f8.fused_expert_mlp_fp8(xs[i], *routing[i], *fp8w[i], cfg,
                                                                             prescale=pre) for i in range(L)],
                                   args.reps) / L * 1e3 for pre in (False, True)}
            try:
                got = f8.fused_expert_mlp_fp8(xs[0], *routing[0], *fp8w[0], cfg, prescale=True)
                same = torch.equal(got, fm.fused_expert_mlp(xs[0], *routing[0], *deq[0], cfg))
            except Exception as e:  # noqa: BLE001 - a tile that does not fit: the next config
                print(f"T={t:5d} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            row[name] = {"config": cfg.label(), "scaled_us": times[False], "prescaled_us": times[True],
                         "prescaled_is_bf16_kernels_bitwise": bool(same)}
            print(f"T={t:5d} {name:12s} {cfg.label()}: products scaled {times[False]:7.1f} us, weights "
                  f"prescaled {times[True]:7.1f} us (x{times[False] / times[True]:.2f}); prescaled == the "
                  f"bf16 kernels on the dequantized bf16 weights: {same}", flush=True)
        out["rows"].append(row)
    return out


def load_fp8_table(path: str) -> dict:
    """The kernel part's best config per T (its JSON) as MEASURED_FP8 for the 30B-A3B expert
    shape, so the engine runs what was just measured; a missing file leaves the committed table."""
    from milepost.kernels import fused_moe_fp8 as f8

    try:
        with open(path) as f:
            rows = json.load(f)["kernel"]["rows"]
        table = []
        for r in sorted(rows, key=lambda r: r["tokens"]):
            d = r["fp8_best_dict"]
            table.append((r["tokens"], f8.MoeConfig(d["block_m"], f8.GemmConfig(**d["gate_up"]),
                                                    f8.GemmConfig(**d["down"]), d["hist_align"])))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"--fp8-table {path} not read ({e!r:.120}); MEASURED_FP8 as committed", flush=True)
        return {}
    f8.MEASURED_FP8[(E, H, I, K)] = tuple(table)
    print(f"MEASURED_FP8 from {path}: " + "; ".join(f"T<={t}: {c.label()}" for t, c in table), flush=True)
    return {str(t): c.label() for t, c in table}


def engine_part(args: argparse.Namespace) -> dict:
    from milepost.bench.args import BenchArgs
    from milepost.bench.engine import run_bench
    from milepost.kernels import fused_moe_fp8 as f8

    committed_prescale = f8.PRESCALE_FROM_TOKENS
    out: dict = {}
    if args.fp8_table:
        out["fp8_table"] = load_fp8_table(args.fp8_table)
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        bench = BenchArgs(shape=args.shape, scenarios="fixed", hf=False, requests=args.requests,
                          prompt_len=args.prompt_len, output_len=args.output_len,
                          max_total_tokens=args.max_total_tokens,
                          quantization=None if mode == "bf16" else "fp8_block",
                          fp8_w8a8_experts=mode == "fp8_block_a8")
        f8.PRESCALE_FROM_TOKENS = 0 if mode == "fp8_block_prescale" else committed_prescale
        try:
            r = run_bench(bench)["scenarios"][0]
        except Exception as e:  # noqa: BLE001 - report, go on with the next mode
            traceback.print_exc()
            out[mode] = f"failed: {str(e).splitlines()[0][:200]}"
            continue
        out[mode] = {k: r.get(k) for k in ("milepost_tok_s", "decode_step_ms", "decode_tok_s",
                                           "bandwidth_fraction", "decode_steps", "tokens")}
        out[mode]["seconds_incl_build"] = time.perf_counter() - t0
        print(f"{mode}: {r['milepost_tok_s']:.0f} tok/s, decode step {r.get('decode_step_ms', 0):.2f} ms, "
              f"decode {r.get('decode_tok_s', 0):.0f} tok/s, {r.get('bandwidth_fraction') or 0:.1%} of its "
              f"bandwidth bound ({time.perf_counter() - t0:.0f} s with build)", flush=True)
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    f8.PRESCALE_FROM_TOKENS = committed_prescale
    for mode in ("fp8_block", "fp8_block_a8", "fp8_block_prescale"):
        if isinstance(out.get("bf16"), dict) and isinstance(out.get(mode), dict):
            a, b = out["bf16"], out[mode]
            out[f"{mode}_over_bf16_tok_s"] = b["milepost_tok_s"] / a["milepost_tok_s"]
            out[f"{mode}_over_bf16_decode"] = a["decode_step_ms"] / b["decode_step_ms"]
            print(f"{mode} / bf16: x{out[f'{mode}_over_bf16_tok_s']:.3f} tok/s, "
                  f"x{out[f'{mode}_over_bf16_decode']:.3f} decode step", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="kernel")
    ap.add_argument("--tokens", default="1,16,64,128,256,1024,4096")
    ap.add_argument("--layers", type=int, default=3, help="distinct weight sets cycled per replay")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--peak-bandwidth", type=float, default=4.8e12)
    ap.add_argument("--modes", default="bf16,fp8_block", help="engine part: of bf16, fp8_block, "
                    "fp8_block_a8 (--fp8-w8a8-experts: expert activations in FP8 too), "
                    "fp8_block_prescale (W8A16 with the weight tiles prescaled)")
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="engine part (tiny: a CPU check)")
    ap.add_argument("--fp8-table", default="", help="engine part: a --parts kernel JSON whose best "
                    "configs the FP8 experts then run (else the committed MEASURED_FP8)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=120000)
    ap.add_argument("--json-out", default="")
    ap.add_argument("--cpu-check", action="store_true",
                    help="kernel part at a tiny shape under TRITON_INTERPRET=1: checks the script only")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.cpu_check:
        global E, H, I, K, DT, DEV, GATE_UP, DOWN, graph_ms
        E, H, I, K, DT, DEV = 8, 256, 128, 2, torch.float32, "cpu"  # interpreter: fp32 tl.dot only
        GATE_UP, DOWN, graph_ms = GATE_UP[:2] + GATE_UP[-1:], DOWN[:2], wall_ms
        args.tokens, args.layers = "1,16", 2
    DEV = DEV if torch.cuda.is_available() else "cpu"
    print(f"device {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}, torch {torch.__version__}",
          flush=True)
    result: dict = {}
    with torch.inference_mode():
        if "kernel" in args.parts:
            result["kernel"] = kernel_part(args)
        if "prescale" in args.parts:
            result["prescale"] = prescale_part(args)
    if "engine" in args.parts:
        result["engine"] = engine_part(args)
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
