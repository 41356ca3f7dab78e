"""The MoE router after its gate GEMM on the GPU (kernels/moe_router.py, issue 27), one call per part:

  kernel: random bf16 gate logits at the Qwen3-30B-A3B router shape (128 experts, top-8,
          renormalized), per token count T: the torch ops (softmax, top-k, sum, divide, cast,
          record), torch's softmax + top-k with the fused end (`finish`), and
          the whole router in one kernel (`fused`, the engine's default, with a grid of rows per program and warps), each
          as `--layers` calls in one CUDA graph (a decode step's MoE layers). Checks: the fused
          kernel's probabilities bitwise torch's softmax, the same experts as torch's top-k (ties
          aside), renormalized weights within an fp32 ulp of torch's.
  engine: `milepost bench engine --shape qwen3-30b-a3b` (fixed: 256 requests x (128 + 256), routed
          experts recorded) with each `--modes` router in this process one after the other: tok/s,
          decode step ms, and the ratio to the first mode.

Usage: PYTHONPATH=$PWD python benchmarks/moe_router_gpu.py --parts kernel,engine
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_sweep import graph_ms  # noqa: E402 - beside this file

E, K = 128, 8


def torch_router(logits: torch.Tensor, rec: torch.Tensor, finish: bool) -> torch.Tensor:
    from milepost.kernels.moe_router import finish_routing

    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, K, dim=-1)
    s = w.sum(dim=-1, keepdim=True)
    if finish:
        return finish_routing(w, s, ids, logits.dtype, rec)
    rec.copy_(ids.to(rec.dtype))
    return (w / s).to(logits.dtype)


def check(tokens: int) -> str:
    """The fused kernel against torch on one batch of logits: what is equal, what is not."""
    from milepost.kernels.moe_router import route

    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, E, device="cuda", generator=g).to(torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    tw, tids = torch.topk(probs, K, dim=-1)
    p, ids = route(logits, K, False, torch.float32, None)
    w, _ = route(logits, K, True, torch.float32, None)
    same_probs = torch.equal(p, probs.gather(1, ids))
    same_sets = torch.equal(ids.sort(dim=-1).values, tids.sort(dim=-1).values)
    same_order = (ids == tids).all(dim=-1).float().mean().item()
    want = probs.gather(1, ids) / tw.sum(dim=-1, keepdim=True)
    ulp = ((w - want).abs() / torch.finfo(torch.float32).eps / want.abs()).max().item()
    return (f"probs bitwise torch's {same_probs}, expert sets equal {same_sets}, slot order equal in "
            f"{same_order:.1%} of rows (ties), renormalized weights within {ulp:.2f} ulp of torch's")


def kernel_part(args: argparse.Namespace) -> None:
    from milepost.kernels.moe_router import route

    for tokens in [int(t) for t in args.tokens.split(",")]:
        print(f"T={tokens}: {check(tokens)}", flush=True)
        logits = [torch.randn(tokens, E, device="cuda").to(torch.bfloat16) for _ in range(args.layers)]
        rec = torch.zeros(tokens, args.layers, K, dtype=torch.int32, device="cuda")
        res = {}
        for name, finish in (("torch", False), ("finish", True)):
            res[name] = graph_ms(lambda f=finish: [torch_router(lg, rec[:, i], f)
                                                   for i, lg in enumerate(logits)], args.reps)
        grid = [(None, None)] + [(b, w) for b in (1, 2, 4, 8, 16) for w in (1, 2, 4)]
        for bt, nw in grid:
            res[f"fused block_t={bt} warps={nw}"] = graph_ms(
                lambda bt=bt, nw=nw: [route(lg, K, True, torch.bfloat16, rec[:, i], bt, nw)
                                      for i, lg in enumerate(logits)], args.reps)
        best = min((k for k in res if k.startswith("fused")), key=res.get)
        fused = res["fused block_t=None warps=None"]
        print(f"  x{args.layers} in one graph, ms: torch ops {res['torch']:.4f}, finish {res['finish']:.4f}, "
              f"fused (default launch) {fused:.4f}, best {best} {res[best]:.4f}; per layer saved vs finish "
              f"{(res['finish'] - fused) / args.layers * 1e3:.2f} us", flush=True)


def engine_part(args: argparse.Namespace) -> None:
    from milepost.bench.args import BenchArgs
    from milepost.bench.engine import run_bench
    from milepost.models.qwen3_moe import SparseMoeBlock

    default = SparseMoeBlock.router_kernels

    first = None
    for mode in args.modes.split(","):
        SparseMoeBlock.router_kernels = mode
        t0 = time.perf_counter()
        bench = BenchArgs(shape=args.shape, scenarios="fixed", hf=False, requests=args.requests,
                          prompt_len=args.prompt_len, output_len=args.output_len)
        r = run_bench(bench)["scenarios"][0]
        line = (f"router {mode}: {r['milepost_tok_s']:.0f} tok/s, decode step "
                f"{r.get('decode_step_ms', 0):.2f} ms, decode {r.get('decode_tok_s', 0):.0f} tok/s ({time.perf_counter() - t0:.0f} s with build)")
        if first is None:
            first = r
        else:
            line += (f"; x{r['milepost_tok_s'] / first['milepost_tok_s']:.3f} tok/s, "
                     f"x{first['decode_step_ms'] / r['decode_step_ms']:.3f} decode step vs the first")
        print(line, flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    SparseMoeBlock.router_kernels = default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="kernel")
    ap.add_argument("--tokens", default="1,64,256,4096")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--modes", default="finish,fused,finish", help="engine part: router kernels in order")
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_router_gpu.py needs a CUDA device")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if "kernel" in args.parts:
        with torch.inference_mode():
            kernel_part(args)
    if "engine" in args.parts:
        engine_part(args)


if __name__ == "__main__":
    main()
