"""P2P with several trainer processes as sources (report 4.2), for benchmarks/weight_update.py.

Every source is a real process (`run_ranks`, gloo default group) holding the same fp32 master
weights, as FSDP ranks do after their gathers; each runs the production path (`WeightSync` over
`P2PTransport(source_rank=r, num_sources=N)`) and writes only to the engines the transfer plan
gives it. A barrier stands in for the gathers that keep real ranks in step. The time is rank 0's
`update()`, whose finish waits until every engine, whoever fed it, reports the new version.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from milepost.testing.dist import run_ranks
from milepost.weights.p2p import P2PTransport
from milepost.weights.sync import WeightSync


def _source(rank: int, world: int, ckpt: str, urls: list[str], repeats: int, bucket_bytes: int,
            verify: bool) -> dict:
    named = [(n, t.float()) for n, t in load_file(f"{ckpt}/model.safetensors").items()]
    gen = torch.Generator().manual_seed(0)  # the same steps on every rank: the same weights
    transport = P2PTransport(urls, "gloo", source_rank=rank, num_sources=world)
    sync = WeightSync(transport, bucket_bytes, dtype=torch.float32)
    times = []
    try:
        for i in range(repeats + 1):
            if i:
                for _, t in named:
                    noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                    t.add_(1e-4 * t.abs() * noise)
            dist.barrier()
            t0 = time.perf_counter()
            sync.update(iter(named), f"src{world}-{i}")
            if i:
                times.append(time.perf_counter() - t0)
        if verify and rank == 0:
            dist.barrier()  # every source finished its last update
            assert sync.verify(named) == len(named)
        elif verify:
            dist.barrier()
    finally:
        sync.close()
    return {"times": times, "targets": transport.targets, "sent": transport.bytes_sent}


def bench_p2p_sources(ckpt: str, urls: list[str], sources: int, repeats: int, bucket_bytes: int,
                      verify: bool) -> tuple[float, str]:
    """(median seconds per update on rank 0, a note naming each source's engines)."""
    results = run_ranks(_source, sources, ckpt, urls, repeats, bucket_bytes, verify,
                        timeout_s=1800)
    plan = " ".join(f"r{r}->{res['targets']}" for r, res in enumerate(results))
    return statistics.median(results[0]["times"]), f"{sources} sources: {plan}"
