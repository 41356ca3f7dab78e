"""Trainer memory (issue 9): peak device memory of a train step and offload / reload times,
with and without streaming the Adam moments from disk, offloading to host or to disk.

Random weights (nothing downloaded), one rank. Every variant is measured in the same run and
printed beside the plain one (ratios). On a GPU (default: Qwen3-0.6B shape, bf16):
    python benchmarks/train_memory.py
On CPU, a quick check of the machinery (absolute numbers mean little there):
    python benchmarks/train_memory.py --device cpu --shape tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import TrainBatch
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.types import Sample

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=40960),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=4096),
}
VARIANTS = [  # name, streamed, offload destination
    ("plain, offload to host", False, "host"),
    ("streamed, offload to host", True, "host"),
    ("plain, offload to disk", False, "disk"),
    ("streamed, offload to disk", True, "disk"),
]


def _rss_growth_during(fn) -> tuple[float, int]:
    """fn's wall time and how far the process's resident memory rose above where it started."""
    def status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        return 0

    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    start = status("VmRSS:")
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, status("VmHWM:") - start


def bench(rank: int, world: int, path: str, device: str, dtype: str, work: str, samples: int,
          length: int, staging: int) -> list[dict]:
    cuda = device == "cuda"
    g = torch.Generator().manual_seed(0)
    items = [Sample(0, i, tokens=torch.randint(10, 4000, (length,), generator=g).tolist(),
                    response_length=length // 2) for i in range(samples)]
    batch = TrainBatch.from_samples(items, [torch.randn(length // 2, generator=g) for _ in items])
    rows = []
    for name, streamed, dest in VARIANTS:
        s = TrainerSettings(lr=1e-6, global_batch_size=samples, max_tokens_per_micro_batch=8192,
                            device=device, dtype=dtype, offload_destination=dest,
                            offload_dir=f"{work}/offload", offload_staging_bytes=staging,
                            optimizer_state_dir=f"{work}/opt" if streamed else None)
        backend = FSDPBackend.create(path, s)
        backend.train_step(batch)  # warm-up: the optimizer state exists from here on
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        backend.train_step(batch)
        if cuda:
            torch.cuda.synchronize()
        step_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        held = torch.cuda.memory_allocated() if cuda else 0
        stats = {}
        off_s, off_rss = _rss_growth_during(lambda: stats.setdefault("off", backend.offload()))
        left = torch.cuda.memory_allocated() if cuda else 0
        on_s, _ = _rss_growth_during(backend.onload)
        rows.append({"variant": name, "step_s": step_s, "peak_bytes": peak, "held_bytes": held,
                     "left_after_offload_bytes": left, "moved_bytes": stats["off"].bytes,
                     "offload_s": off_s, "reload_s": on_s, "offload_rss_growth_bytes": off_rss})
        del backend
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--dtype", default=None, help="compute dtype; default bfloat16 on cuda, else float32")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--length", type=int, default=1024, help="tokens per sample (half response)")
    ap.add_argument("--staging-bytes", type=int, default=64 << 20)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint(Path(d) / "m", "qwen3", with_tokenizer=False, **SHAPES[a.shape])
        [rows] = run_ranks(bench, 1, str(path), a.device, dtype, d, a.samples, a.length,
                           a.staging_bytes, backend="nccl" if a.device == "cuda" else "gloo",
                           timeout_s=580)
    gib = 2**30
    base = {dest: next(r for r in rows if r["variant"] == f"plain, offload to {dest}")
            for dest in ("host", "disk")}
    print(f"{a.shape} {dtype} on {a.device}, {a.samples} x {a.length} tokens per step, "
          f"staging buffer {a.staging_bytes / 2**20:.0f} MiB")
    print(f"{'variant':28} {'step s':>7} {'peak GiB':>9} {'held GiB':>9} {'moved GiB':>10} "
          f"{'offload s':>10} {'reload s':>9} {'RSS rise MiB':>13}  vs plain (peak, offload, reload)")
    for r in rows:
        b = base["disk" if r["variant"].endswith("disk") else "host"]
        ratio = lambda k: r[k] / b[k] if b[k] else float("nan")  # noqa: E731
        print(f"{r['variant']:28} {r['step_s']:7.2f} {r['peak_bytes'] / gib:9.2f} "
              f"{r['held_bytes'] / gib:9.2f} {r['moved_bytes'] / gib:10.2f} {r['offload_s']:10.3f} "
              f"{r['reload_s']:9.3f} {r['offload_rss_growth_bytes'] / 2**20:13.1f}  "
              f"{ratio('peak_bytes'):.2f}x {ratio('offload_s'):.2f}x {ratio('reload_s'):.2f}x")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
