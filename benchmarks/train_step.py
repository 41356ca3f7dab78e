"""Trainer throughput: FSDPBackend.train_step and compute_logprobs on one GPU, Qwen3-0.6B shape.

Random weights (nothing is downloaded). Prints tokens/s of a train step (log-probs of the old
policy + forward/backward + AdamW) and of scoring alone, and the peak GPU memory. `--profile`
also profiles one more train step (torch.profiler) and prints the top ops by device and by host
time (written whole to --profile-out). `milepost bench train` gives the same step beside a
Hugging Face loop.
    python benchmarks/train_step.py [--samples 32] [--prompt 512] [--response 512] [--profile]
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


def profile_step(backend: FSDPBackend, batch: TrainBatch) -> str:
    """Top ops of one train step by self device time, then by self host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        backend.train_step(batch)
        torch.cuda.synchronize()
    table = prof.key_averages()
    return "\n".join([table.table(sort_by="self_cuda_time_total", row_limit=30),
                      table.table(sort_by="self_cpu_time_total", row_limit=20)])


def bench(rank: int, world: int, path: str, samples: int, prompt: int, response: int, mb_tokens: int,
          checkpointing: str = "none", profile: bool = False, compile_layers: bool = False,
          fused_kernels: bool = True, lora_rank: int = 0) -> dict:
    lora = {"lora_rank": lora_rank, "lora_alpha": 2.0 * lora_rank} if lora_rank else {}
    s = TrainerSettings(lr=1e-6, global_batch_size=samples, max_tokens_per_micro_batch=mb_tokens, device="cuda",
                        dtype="bfloat16", activation_checkpointing=checkpointing, compile_layers=compile_layers,
                        fused_kernels=fused_kernels, **lora)
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
    table = profile_step(backend, batch) if profile else ""
    return {
        "profile": table,
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
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--activation-checkpointing", choices=("none", "layer"), default="none")
    ap.add_argument("--compile-layers", action="store_true", help="TrainerSettings.compile_layers")
    ap.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction, default=True,
                    help="TrainerSettings.fused_kernels (--no-fused-kernels: the torch ops)")
    ap.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank on all seven "
                    "projections (alpha 2 x rank) instead of the whole model")
    ap.add_argument("--profile", action="store_true", help="profile one more train step")
    ap.add_argument("--profile-out", default="train_step_profile.txt")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint(Path(d) / "m", "qwen3", vocab_size=151936, with_tokenizer=False, **QWEN3_06B)
        [r] = run_ranks(bench, 1, str(path), a.samples, a.prompt, a.response, a.micro_batch_tokens,
                         a.activation_checkpointing, a.profile, a.compile_layers, a.fused_kernels,
                         a.lora_rank, backend="nccl", timeout_s=540)
    print(
        f"Qwen3-0.6B shape bf16, {a.samples} x ({a.prompt}+{a.response}) tokens, micro-batch {a.micro_batch_tokens}"
        f"{'' if a.fused_kernels else ', fused kernels off'}{f', LoRA rank {a.lora_rank}' if a.lora_rank else ''}: "
        f"train {r['train_tok_s']:.0f} tok/s ({r['train_s']:.2f} s/step), score {r['score_tok_s']:.0f} tok/s, "
        f"peak {r['peak_gib']:.1f} GiB"
    )
    if a.profile:
        Path(a.profile_out).write_text(r["profile"] + "\n")
        print(r["profile"][:6000])


if __name__ == "__main__":
    main()
