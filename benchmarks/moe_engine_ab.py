"""`milepost bench engine` benchmark (a) on the Qwen3-30B-A3B shape (random weights, bf16, routed
experts recorded) twice in one process: MoE experts on the grouped GEMMs, then on the fused Triton
path where kernels/fused_moe.py's measured table picks it. Same requests, same settings; prints
both tables and the ratio. Each run builds its own random model (the same seed).

Usage: PYTHONPATH=$PWD python benchmarks/moe_engine_ab.py [--requests 256] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

from milepost.bench.args import BenchArgs
from milepost.bench.engine import print_table, run_bench
from milepost.kernels import fused_moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=120000,
                    help="KV pool tokens (the 2026-12-02 30B run was refused without it)")
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--json-out", default="")
    args = ap.parse_args()
    bench = BenchArgs(shape="qwen3-30b-a3b", scenarios="fixed", hf=False, requests=args.requests,
                      prompt_len=args.prompt_len, output_len=args.output_len,
                      max_total_tokens=args.max_total_tokens, chunked_prefill_size=args.chunked_prefill_size)
    measured = dict(fused_moe.MEASURED)
    results = {}
    for mode in ("grouped", "fused"):
        fused_moe.MEASURED = measured if mode == "fused" else {}
        print(f"== experts: {mode} ==", flush=True)
        results[mode] = run_bench(bench)
        print_table(results[mode])
        gc.collect()
        torch.cuda.empty_cache()
    fused_moe.MEASURED = measured
    a, b = (results[m]["scenarios"][0] for m in ("grouped", "fused"))
    print(f"fixed {args.requests} x {args.prompt_len} -> {args.output_len}: grouped {a['milepost_tok_s']:.0f} "
          f"tok/s (decode step {a.get('decode_step_ms', 0):.2f} ms), fused {b['milepost_tok_s']:.0f} tok/s "
          f"(decode step {b.get('decode_step_ms', 0):.2f} ms): x{b['milepost_tok_s'] / a['milepost_tok_s']:.3f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
