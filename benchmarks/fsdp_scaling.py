"""FSDP2 trainer scaling (issue 10, run 2): training tokens/s on 1, 2, 4 ... ranks, same global batch.

Every world size trains the same global batch (the same samples, split evenly over the ranks) of a
random-weight model, one warm-up step then `--steps` timed steps; the throughput of each world
size is printed beside the single-rank run of the same invocation (speed-up and efficiency).
On GPUs (one rank per GPU, NCCL; default Qwen3-0.6B shape, bf16):
    python benchmarks/fsdp_scaling.py --ranks 1,2,4
On CPU (gloo; checks the machinery, the numbers mean little on a 2-core machine):
    python benchmarks/fsdp_scaling.py --device cpu --shape tiny --ranks 1,2 --samples 8 --length 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import TrainBatch
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=4096),
}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train_rank(rank: int, world: int, path: str, device: str, dtype: str, samples: int,
               length: int, steps: int, mb_tokens: int, vocab: int) -> dict:
    """One rank: its share of the global batch, a warm-up step, then `steps` timed steps."""
    s = TrainerSettings(lr=1e-6, global_batch_size=samples, max_tokens_per_micro_batch=mb_tokens,
                        device=device, dtype=dtype)
    backend = FSDPBackend.create(path, s)
    g = torch.Generator().manual_seed(0)  # every rank draws the same global batch, keeps its share
    items = [Sample(0, i, tokens=torch.randint(10, vocab, (length,), generator=g).tolist(),
                    response_length=length // 2) for i in range(samples)]
    advantages = [torch.randn(length // 2, generator=g) for _ in items]
    mine = list(range(rank, samples, world))
    batch = TrainBatch.from_samples([items[i] for i in mine], [advantages[i] for i in mine])
    backend.train_step(batch)  # warm-up: optimizer state, kernels, allocator
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        backend.train_step(batch)
    _sync(device)
    dist.barrier()
    seconds = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    return {"step_s": seconds, "peak_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, else float32")
    ap.add_argument("--ranks", default="1,2,4", help="comma list of world sizes; 1 is the baseline")
    ap.add_argument("--samples", type=int, default=32, help="global batch (samples per step)")
    ap.add_argument("--length", type=int, default=1024, help="tokens per sample (half response)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    worlds = sorted({int(x) for x in a.ranks.split(",")})
    if a.device == "cuda" and worlds[-1] > torch.cuda.device_count():
        ap.error(f"--ranks asks for {worlds[-1]} ranks, this machine has "
                 f"{torch.cuda.device_count()} GPU(s)")
    for w in worlds:
        if a.samples % w:
            ap.error(f"--samples {a.samples} must split evenly over {w} ranks")
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    shape = SHAPES[a.shape]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint(Path(d) / "m", "qwen3", with_tokenizer=False, **shape)
        for w in worlds:
            results = run_ranks(train_rank, w, str(path), a.device, dtype, a.samples, a.length,
                                a.steps, a.micro_batch_tokens, shape["vocab_size"],
                                backend="nccl" if a.device == "cuda" else "gloo", timeout_s=580)
            step_s = max(r["step_s"] for r in results)  # the step ends when the slowest rank does
            rows.append({"ranks": w, "step_s": step_s, "tok_s": a.samples * a.length / step_s,
                         "peak_bytes_per_rank": max(r["peak_bytes"] for r in results)})
            print(f"  {w} rank(s): {step_s:.3f} s/step", flush=True)
    base = next((r for r in rows if r["ranks"] == 1), rows[0])
    print(f"{a.shape} {dtype} on {a.device}: global batch {a.samples} x {a.length} tokens, "
          f"{a.steps} timed steps after a warm-up")
    print(f"{'ranks':>5} {'s/step':>8} {'tokens/s':>10} {'speed-up':>9} {'efficiency':>11} "
          f"{'peak GiB/rank':>14}")
    for r in rows:
        up = r["tok_s"] / base["tok_s"]
        print(f"{r['ranks']:5d} {r['step_s']:8.3f} {r['tok_s']:10.0f} {up:8.2f}x "
              f"{up * base['ranks'] / r['ranks']:10.0%} {r['peak_bytes_per_rank'] / 2**30:14.2f}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
