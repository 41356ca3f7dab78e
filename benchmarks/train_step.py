"""Trainer throughput: FSDPBackend.train_step and compute_logprobs on one GPU, Qwen3-0.6B shape.

Random weights (nothing is downloaded). Prints tokens/s of a train step (log-probs of the old
policy + forward/backward + AdamW) and of scoring alone, and the peak GPU memory.
    python benchmarks/train_step.py [--samples 32] [--prompt 512] [--response 512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import TrainBatch
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

QWEN3_06B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, initializer_range=0.02,
)


def bench(rank: int, world: int, path: str, samples: int, prompt: int, response: int, mb_tokens: int) -> dict:
    s = TrainerSettings(lr=1e-6, global_batch_size=samples, max_tokens_per_micro_batch=mb_tokens, device="cuda", dtype="bfloat16")
    backend = FSDPBackend.create(path, s)
    g = torch.Generator().manual_seed(0)
    items = [
        Sample(0, i, tokens=torch.randint(10, 150000, (prompt + response,), generator=g).tolist(), response_length=response)
        for i in range(samples)
    ]
    batch = TrainBatch.from_samples(items, [torch.randn(response, generator=g) for _ in items])
    backend.train_step(batch)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    metrics = backend.train_step(batch)
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t
    t = time.perf_counter()
    backend.compute_logprobs(items)
    torch.cuda.synchronize()
    score_s = time.perf_counter() - t
    tokens = samples * (prompt + response)
    return {
        "train_tok_s": tokens / train_s,
        "score_tok_s": tokens / score_s,
        "train_s": train_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "grad_norm": metrics["grad_norm"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint(Path(d) / "m", "qwen3", vocab_size=151936, with_tokenizer=False, **QWEN3_06B)
        [r] = run_ranks(bench, 1, str(path), a.samples, a.prompt, a.response, a.micro_batch_tokens, backend="nccl", timeout_s=540)
    print(
        f"Qwen3-0.6B shape bf16, {a.samples} x ({a.prompt}+{a.response}) tokens, micro-batch {a.micro_batch_tokens}: "
        f"train {r['train_tok_s']:.0f} tok/s ({r['train_s']:.2f} s/step), score {r['score_tok_s']:.0f} tok/s, "
        f"peak {r['peak_gib']:.1f} GiB"
    )


if __name__ == "__main__":
    main()
