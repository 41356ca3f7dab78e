"""Time per weight update, per transport, against model size (issue 8).

Starts real `milepost serve` engines on random Qwen3 checkpoints of several sizes and pushes the
same weights through each transport with the production path (`WeightSync`, fixed-size buckets),
timing `update()` end to end from fp32 master weights already in memory (no gather; the cast to
the engines' dtype is inside, as in a trainer's export). Each
update after the first applies a small Adam-like step to every weight (w += 1e-4 * |w| * noise),
so disk-delta publishes what an RL step would. Prints seconds per update (median of --repeats
after one warm-up) and the ratio to broadcast measured in the same run (or to tensor when
broadcast is not run).

    python benchmarks/weight_update.py                                   # CPU, 2 engines
    python benchmarks/weight_update.py --transports broadcast,p2p,p2p-x2  # 2 trainer sources
    python benchmarks/weight_update.py --device cuda --sizes qwen3-0.6b \
        --engines 1 --transports tensor,disk-delta                       # one GPU
    python benchmarks/weight_update.py --device cuda --sizes qwen3-0.6b \
        --engines 1 --transports tensor,p2p           # p2p picks CUDA IPC (same host and GPU)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.disk_transport import DiskDeltaTransport
from milepost.weights.p2p import P2PTransport
from milepost.weights.sync import WeightSync
from milepost.weights.transport import BroadcastTransport, TensorTransport
from weight_update_sources import bench_p2p_sources  # noqa: E402 - benchmarks/ is sys.path[0]

SIZES = {  # make_tiny_checkpoint overrides; fp32 bytes on disk in the comment
    "s": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, vocab_size=4096),  # ~5 MB
    "m": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=8192),  # ~25 MB
    "l": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, vocab_size=16384),  # ~110 MB
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151936, max_position_embeddings=4096,
                       tie_word_embeddings=True),  # 0.6B parameters
}


def transport(kind: str, urls: list[str], backend: str, store: Path):
    if kind == "tensor":
        return TensorTransport(urls)
    if kind == "broadcast":
        return BroadcastTransport(urls, backend)
    if kind == "p2p":
        return P2PTransport(urls, backend)
    if kind == "disk-delta":
        return DiskDeltaTransport(urls, store, pause_mode=None)
    raise SystemExit(f"unknown transport {kind!r}")


def step(named: list[tuple[str, torch.Tensor]], gen: torch.Generator) -> None:
    """An Adam-like step on every weight, in place (noise drawn where the weights live)."""
    for _, t in named:
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32, device=t.device)
        t.add_((1e-4 * t.float().abs() * noise).to(t.dtype))


def bench_size(size: str, args: argparse.Namespace, work: Path) -> dict[str, tuple[float, str]]:
    ckpt = make_tiny_checkpoint(work / size, "qwen3", with_tokenizer=False, **SIZES[size])
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    device = torch.device(args.device)
    # fp32 master weights, sent cast to the engines' dtype, as a trainer does: a small step on
    # bf16 weights themselves would round back to the same bytes.
    named = [(n, t.float().to(device)) for n, t in load_file(ckpt / "model.safetensors").items()]
    nbytes = sum(t.numel() * dtype.itemsize for _, t in named)
    flags = ["--max-total-tokens", "256", "--device", args.device,
             "--dtype", "bfloat16" if args.device == "cuda" else "float32"]
    if args.device == "cuda":
        flags += ["--mem-fraction-static", str(0.8 / args.engines), "--disable-cuda-graph"]
    with ThreadPoolExecutor(args.engines) as pool:
        engines = list(pool.map(lambda _: ServerProcess(ckpt, *flags, timeout_s=600),
                                range(args.engines)))
    results: dict[str, tuple[float, str]] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        urls = [e.url for e in engines]
        backend = "nccl" if args.device == "cuda" else "gloo"
        for kind in args.transports:
            if kind.startswith("p2p-x"):  # several trainer processes as sources (CPU, gloo)
                if args.device != "cpu":
                    raise SystemExit(f"{kind}: several sources are measured on CPU only")
                results[kind] = bench_p2p_sources(str(ckpt), urls, int(kind[5:]), args.repeats,
                                                  args.bucket_mb << 20, args.verify)
                continue
            store = work / f"store-{size}-{kind}"
            sync = WeightSync(transport(kind, urls, backend, store), args.bucket_mb << 20,
                              dtype=dtype)
            times, extra = [], ""
            try:
                for i in range(args.repeats + 1):
                    if i:
                        step(named, gen)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    stats = sync.update(iter(named), f"{kind}-{i}")
                    if i:  # the first is a warm-up (groups, base snapshot)
                        times.append(time.perf_counter() - t0)
                if kind == "p2p":  # which P2PBackend the transport chose (cuda-ipc, gloo, nccl)
                    extra = f"path {sync.transport.path}"
                if stats.metrics:
                    m = stats.metrics
                    extra = (f"changed {m['perf/update_weights_delta_changed_fraction']:.2f}, "
                             f"wrote {m['perf/update_weights_delta_bytes_written'] / 2**20:.1f} MiB")
                if args.verify:  # verify() casts like update() does
                    assert sync.verify(named) == len(named)
            finally:
                sync.close()
                shutil.rmtree(store, ignore_errors=True)
            results[kind] = (statistics.median(times), extra)
    finally:
        for e in engines:
            e.close()
    base = "broadcast" if "broadcast" in results else next(iter(results))
    print(f"\n{size}: {nbytes / 2**20:.1f} MiB of {str(dtype).removeprefix('torch.')} weights, "
          f"{args.engines} engine(s), bucket {args.bucket_mb} MiB, {args.device}")
    for kind, (sec, extra) in results.items():
        ratio = sec / results[base][0]
        print(f"  {kind:10s} {sec:8.3f} s/update   x{ratio:5.2f} vs {base}   {extra}")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", default="s,m,l", help=f"comma list of {', '.join(SIZES)}")
    ap.add_argument("--transports", default="tensor,broadcast,p2p,disk-delta",
                    help="comma list of tensor, broadcast, p2p, disk-delta, p2p-xN (p2p from N "
                    "trainer processes, CPU)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--verify", action="store_true", help="check the engines' weights at the end")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads of this (trainer) process; engines run with 1. On a "
                    "host whose cores the engines share, more threads make every torch copy "
                    "wait on OpenMP barriers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.transports = args.transports.split(",")
    work = Path(tempfile.mkdtemp(prefix="weight-update-bench-"))
    try:
        for size in args.sizes.split(","):
            bench_size(size, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
