"""Fused INT4 MoE decode vs the bf16 fused MoE at the Qwen3-30B-A3B expert shape (issue 23), in one
process on one GPU: 128 experts, hidden 2048, moe_intermediate 768, top-8, random bf16 weights
packed by the engine's INT4 store (lowprec/experts_int4.py).

Per token count T: the bf16 experts (StackedExperts: the fused bf16 kernel with its measured
config, as the engine runs them), the INT4 experts (the fused W4A16 kernels,
kernels/fused_moe_int4.py) and the path they replaced (routed experts dequantized into bf16
copies, then the bf16 experts), each as CUDA-graph replays over `--layers` weight sets with
their own routing (weights from HBM, not L2), after a check against an fp32 loop; prints ms per
layer call and the ratio bf16 / INT4 measured in this run. `--sweep` also times a grid of INT4
tiles per T and prints the best as a MEASURED_INT4 table.

Usage: PYTHONPATH=$PWD python benchmarks/int4_moe_gpu.py --json-out $OUT/int4_moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_sweep import graph_ms  # noqa: E402 - beside this file

E, H, I, K = 128, 2048, 768, 8
# (block_n, block_k, num_warps, num_stages, swap_ab) per GEMM; BLOCK_K divides the 128-wide group
GRID = ((32, 128, 4, 4, True), (64, 128, 4, 3, True), (64, 64, 4, 4, True), (128, 128, 4, 3, True),
        (128, 64, 8, 3, True), (64, 128, 4, 3, False), (128, 64, 4, 4, False))


def layer(seed: int):
    """(INT4 experts, bf16 experts holding the same random weights unquantized)."""
    from milepost.lowprec.experts_int4 import _pack
    from milepost.models.qwen3_moe import StackedExperts

    torch.manual_seed(seed)
    with torch.no_grad():
        bf16 = StackedExperts(E, H, I).cuda().bfloat16()
        bf16.w13.normal_(0, 0.02)
        bf16.w2.normal_(0, 0.02)
        int4 = StackedExperts(E, H, I).cuda().bfloat16()
        int4.w13.copy_(bf16.w13)
        int4.w2.copy_(bf16.w2)
        _pack(int4)
    return int4, bf16


def main() -> None:
    from milepost.kernels import fused_moe_int4 as f4
    from milepost.kernels.fused_moe import GemmConfig, MoeConfig
    from milepost.testing.moe_reference import expert_loop, routed_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,64,256")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json-out", default="")
    args = ap.parse_args()
    sets = [layer(i) for i in range(args.layers)]
    assert f4.kernel_ok(sets[0][0].w13.device), "the fused INT4 MoE kernels failed their probe"
    rows, best = [], []
    print(f"{torch.cuda.get_device_name()}: INT4 MoE decode vs bf16 (E={E} H={H} I={I} k={K})", flush=True)
    with torch.inference_mode():
        for t in [int(v) for v in args.tokens.split(",")]:
            inputs = [routed_inputs(t, H, E, K, seed=100 * t + j) for j in range(args.layers)]
            mod, plain = sets[0]
            x, ids, w = inputs[0]
            ref = expert_loop(x, ids, w, *mod.expert_weights())
            err = ((mod(x, ids, w).float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"T={t}: INT4 fused off the fp32 loop by {err:.3g}"

            def run(fn):
                return lambda: [fn(m, *inp) for (m, _), inp in zip(sets, inputs)]

            ms = {
                "bf16": graph_ms(lambda: [p(*inp) for (_, p), inp in zip(sets, inputs)], args.reps),
                "int4_fused": graph_ms(run(lambda m, *a: m(*a)), args.reps),
                "int4_old": graph_ms(run(lambda m, x_, i_, w_: m._routed_only(x_, i_, w_)
                                         if i_.numel() < E else super(type(m), m).forward(x_, i_, w_)),
                                     args.reps),
            }
            ms = {k: v / args.layers for k, v in ms.items()}
            row = {"tokens": t, "rel_err": err, **{f"{k}_ms": v for k, v in ms.items()},
                   "bf16_over_int4": ms["bf16"] / ms["int4_fused"],
                   "old_over_int4": ms["int4_old"] / ms["int4_fused"], "cfg": f4.config_for(t, E, H, I, K).label()}
            print(f"T={t:4d}  bf16 {ms['bf16']:.3f} ms  int4 fused {ms['int4_fused']:.3f} ms  "
                  f"int4 old {ms['int4_old']:.3f} ms  bf16/int4 {row['bf16_over_int4']:.2f}x  "
                  f"old/int4 {row['old_over_int4']:.2f}x  err {err:.2e}", flush=True)
            if args.sweep:
                cands = []
                for bm in (16, 32) if t > 64 else (16,):
                    for gu in GRID:
                        for dn in GRID:
                            cfg = MoeConfig(bm, GemmConfig(*gu[:4], 8, gu[4]), GemmConfig(*dn[:4], 8, dn[4]), t > 1)
                            got = f4.fused_expert_mlp_int4(x, ids, w, mod.w13, mod.w13_scale, mod.w2,
                                                           mod.w2_scale, cfg)
                            if ((got.float() - ref).norm() / ref.norm()).item() >= 1e-2:
                                print(f"  {cfg.label()}: WRONG", flush=True)
                                continue
                            cands.append((graph_ms(run(lambda m, x_, i_, w_, c=cfg: f4.fused_expert_mlp_int4(
                                x_, i_, w_, m.w13, m.w13_scale, m.w2, m.w2_scale, c)), args.reps)
                                / args.layers, cfg))
                ms_best, cfg_best = min(cands, key=lambda c: c[0])
                row["best_ms"], row["best_cfg"] = ms_best, cfg_best.label()
                best.append((t, cfg_best))
                print(f"  best {ms_best:.3f} ms {cfg_best.label()} (bf16/best {ms['bf16'] / ms_best:.2f}x)",
                      flush=True)
            rows.append(row)
    if best:
        print("MEASURED_INT4 = {(%d, %d, %d, %d): (" % (E, H, I, K))
        for t, c in best:
            g, d = c.gate_up, c.down
            print(f"    ({t}, _c({c.block_m}, ({g.block_n}, {g.block_k}, {g.num_warps}, {g.num_stages}, "
                  f"{g.swap_ab}), ({d.block_n}, {d.block_k}, {d.num_warps}, {d.num_stages}, {d.swap_ab}), "
                  f"hist={c.hist_align})),")
        print(")}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
