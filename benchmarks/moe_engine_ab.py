"""`milepost bench engine` benchmark (a) on the Qwen3-30B-A3B shape (random weights, bf16, routed
experts recorded) twice on one machine: MoE experts on the grouped GEMMs, then on the fused Triton
path where kernels/fused_moe.py's measured table picks it. Same requests and settings; each run in
its own process (all GPU memory back between them); prints both tables and the ratio.

Usage: PYTHONPATH=$PWD python benchmarks/moe_engine_ab.py [--requests 256] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _compile(cfg: object) -> None:
    """A pool worker: run one measured config once on the 30B-A3B expert shape (Triton's disk cache)."""
    import torch

    from milepost.kernels.fused_moe import fused_expert_mlp

    x = torch.zeros(64, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (64, 8), device="cuda")
    w13 = torch.zeros(128, 1536, 2048, device="cuda", dtype=torch.bfloat16)
    w2 = torch.zeros(128, 2048, 768, device="cuda", dtype=torch.bfloat16)
    fused_expert_mlp(x, ids, torch.ones(64, 8, device="cuda", dtype=torch.bfloat16), w13, w2, cfg)
    torch.cuda.synchronize()


def precompile_async() -> object | None:
    """Compile the measured configs in spawned processes while the model is built (a fresh machine
    compiled them one by one inside the engine's start otherwise); the pool is returned to join."""
    import multiprocessing as mp

    import torch

    from milepost.kernels import fused_moe

    cfgs = sorted({c for b in fused_moe.MEASURED.values() for _, c in b if c is not None}, key=repr)
    if not torch.cuda.is_available() or not cfgs:
        return None
    try:
        pool = mp.get_context("spawn").Pool(len(cfgs))
        pool.map_async(_compile, cfgs)
        pool.close()
        return pool
    except Exception as e:  # noqa: BLE001 - the engine then compiles them itself
        print(f"precompile not started: {e}", flush=True)
        return None


def run_one(mode: str, args: argparse.Namespace, out: Path) -> None:
    from milepost.bench.args import BenchArgs
    from milepost.bench.engine import print_table, run_bench
    from milepost.kernels import fused_moe

    pool = None
    if mode == "grouped":
        fused_moe.MEASURED = {}  # no shape measured: every MoE layer keeps the grouped GEMMs
    elif args.shape == "qwen3-30b-a3b":
        pool = precompile_async()
    bench = BenchArgs(shape=args.shape, scenarios="fixed", hf=False, requests=args.requests,
                      prompt_len=args.prompt_len, output_len=args.output_len,
                      max_total_tokens=args.max_total_tokens, chunked_prefill_size=args.chunked_prefill_size)
    result = run_bench(bench)
    print_table(result)
    out.write_text(json.dumps(result, default=str))
    if pool is not None:
        pool.terminate()  # done long before; nothing to wait for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="tiny: a CPU check of this script")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-total-tokens", type=int, default=120000,
                    help="KV pool tokens (the 2026-12-02 30B run was refused without it)")
    ap.add_argument("--chunked-prefill-size", type=int, default=None)
    ap.add_argument("--modes", default="grouped,fused")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: the child's mode
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default="")
    args = ap.parse_args()
    if args.one:
        run_one(args.one, args, Path(args.out))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            out = Path(tmp) / f"{mode}.json"
            print(f"== experts: {mode} ==", flush=True)
            cmd = [sys.executable, __file__, "--one", mode, "--out", str(out)] + sys.argv[1:]
            if subprocess.run(cmd).returncode == 0 and out.exists():
                results[mode] = json.loads(out.read_text())
    rows = {m: r["scenarios"][0] for m, r in results.items()}
    for m, r in rows.items():
        print(f"{m}: {r['milepost_tok_s']:.0f} tok/s, decode step {r.get('decode_step_ms', 0):.2f} ms, "
              f"{r.get('bandwidth_fraction') or 0:.1%} of the decode bandwidth bound")
    if len(rows) == 2:
        a, b = rows["grouped"], rows["fused"]
        print(f"fused / grouped: x{b['milepost_tok_s'] / a['milepost_tok_s']:.3f} tok/s")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
