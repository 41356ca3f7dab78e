"""Trainer memory (issue 9): peak device memory of a train step and offload / reload times,
with and without streaming the Adam moments from disk, offloading to host or to disk.

Random weights (nothing downloaded), one rank. Every variant is measured in the same run and
printed beside the plain one (ratios). On a GPU (default: Qwen3-0.6B shape, bf16):
    python benchmarks/train_memory.py
On CPU, a quick check of the machinery (absolute numbers mean little there):
    python benchmarks/train_memory.py --device cpu --shape tiny
The RSS columns are how far the process's resident host memory rose during offload and reload
(peak VmRSS, milepost/train/host_memory.py): for disk offload the issue bounds it by the staging
buffer plus a small constant. `--destinations disk` measures only the disk variants.
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
from milepost.train.host_memory import peak_rss_growth
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


def bench(rank: int, world: int, path: str, device: str, dtype: str, work: str, samples: int,
          length: int, staging: int, variants: list[str] | None = None) -> list[dict]:
    cuda = device == "cuda"
    g = torch.Generator().manual_seed(0)
    items = [Sample(0, i, tokens=torch.randint(10, 4000, (length,), generator=g).tolist(),
                    response_length=length // 2) for i in range(samples)]
    batch = TrainBatch.from_samples(items, [torch.randn(length // 2, generator=g) for _ in items])
    rows = []
    for name, streamed, dest in VARIANTS:
        if variants is not None and name not in variants:
            continue
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
        off = peak_rss_growth(backend.offload)  # host memory: bounded by staging for disk
        left = torch.cuda.memory_allocated() if cuda else 0
        on = peak_rss_growth(backend.onload)
        rows.append({"variant": name, "step_s": step_s, "peak_bytes": peak, "held_bytes": held,
                     "left_after_offload_bytes": left, "moved_bytes": off.result.bytes,
                     "offload_s": off.seconds, "reload_s": on.seconds,
                     "offload_rss_growth_bytes": off.peak_growth_bytes,
                     "reload_rss_growth_bytes": on.peak_growth_bytes, "staging_bytes": staging,
                     # torch's pinned pool, in case the driver's pinned pages are not in VmRSS
                     "offload_pinned_growth_bytes": off.pinned_peak_growth_bytes,
                     "reload_pinned_growth_bytes": on.pinned_peak_growth_bytes})
        print(f"measured: {json.dumps(rows[-1])}", flush=True)  # survives a run cut short
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
    ap.add_argument("--destinations", default="host,disk",
                    help="offload destinations to measure (comma list); `disk` alone gives the "
                    "host-memory (RSS) rows without the host-offload variants")
    a = ap.parse_args()
    destinations = a.destinations.split(",")
    if not destinations or not set(destinations) <= {"host", "disk"}:
        ap.error(f"--destinations: a comma list of host and disk, got {a.destinations!r}")
    variants = [name for name, _, dest in VARIANTS if dest in destinations]
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_checkpoint(Path(d) / "m", "qwen3", with_tokenizer=False, **SHAPES[a.shape])
        [rows] = run_ranks(bench, 1, str(path), a.device, dtype, d, a.samples, a.length,
                           a.staging_bytes, variants, backend="nccl" if a.device == "cuda" else "gloo",
                           timeout_s=580)
    gib = 2**30
    base = {dest: next(r for r in rows if r["variant"] == f"plain, offload to {dest}")
            for dest in destinations}
    print(f"{a.shape} {dtype} on {a.device}, {a.samples} x {a.length} tokens per step, "
          f"staging buffer {a.staging_bytes / 2**20:.0f} MiB")
    print(f"{'variant':28} {'step s':>7} {'peak GiB':>9} {'held GiB':>9} {'moved GiB':>10} "
          f"{'offload s':>10} {'reload s':>9} {'RSS rise MiB':>13} {'reload RSS MiB':>15}  vs plain (peak, offload, reload)")
    for r in rows:
        b = base["disk" if r["variant"].endswith("disk") else "host"]
        ratio = lambda k: r[k] / b[k] if b[k] else float("nan")  # noqa: E731
        print(f"{r['variant']:28} {r['step_s']:7.2f} {r['peak_bytes'] / gib:9.2f} "
              f"{r['held_bytes'] / gib:9.2f} {r['moved_bytes'] / gib:10.2f} {r['offload_s']:10.3f} "
              f"{r['reload_s']:9.3f} {r['offload_rss_growth_bytes'] / 2**20:13.1f} "
              f"{r['reload_rss_growth_bytes'] / 2**20:15.1f}  "
              f"{ratio('peak_bytes'):.2f}x {ratio('offload_s'):.2f}x {ratio('reload_s'):.2f}x")
    disk = [r for r in rows if r["variant"].endswith("disk")]
    if disk and a.device == "cpu":
        print("on cpu the state itself is host memory: the reload's RSS rise is the state coming back")
    if disk:  # the bound: disk offload holds no more host memory than the staging buffer
        rise = max(max(r["offload_rss_growth_bytes"], r["reload_rss_growth_bytes"]) for r in disk)
        print(f"disk offload/reload: highest RSS rise {rise / 2**20:.1f} MiB = staging buffer "
              f"{a.staging_bytes / 2**20:.0f} MiB + {(rise - a.staging_bytes) / 2**20:+.1f} MiB, "
              f"while moving {max(r['moved_bytes'] for r in disk) / gib:.2f} GiB")
        pinned = [r[k] for r in disk for k in ("offload_pinned_growth_bytes", "reload_pinned_growth_bytes")]
        if all(p is not None for p in pinned):
            print(f"disk offload/reload: highest pinned-pool rise {max(pinned) / 2**20:.1f} MiB")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
