"""Peer-to-peer weight transfer (report 4.2) over torch.distributed point-to-point.

Sources (trainer ranks) write each packed bucket straight to their targets (engine ranks) with
send/recv, as opposed to one broadcast to every engine. Three pieces follow the report:

- `transfer_plan`: the first min(sources, targets) pairs map one to one, the remaining targets are
  spread evenly (round robin) over the sources, bounding the sessions any sender keeps.
- One staging buffer (pinned when CUDA is present) is packed once per bucket and reused for every
  target; targets are grouped by engine rank; every group but the last waits for its writes, the
  last group's writes finish in the background while the caller prepares the next bucket.
- `P2PBackend` is the seam an RDMA library fills later (register the staging buffer once, write
  into remote memory); `TorchP2PBackend` is the one here: gloo on CPU, NCCL on GPU.

Deviations, honestly: only trainer rank 0 sends here (WeightSync gathers full tensors and hands
one rank a transport), so every target is planned onto source 0; engines have one tensor-parallel
rank, so each target needs every shard of every tensor and there is no re-sharding step. With one
sender and N engines a bucket crosses the wire N times, where a broadcast sends it once per hop:
on one host P2P is slower than broadcast (benchmarks/RESULTS.md), as the report also finds.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent import futures
from typing import Protocol

import numpy as np
import torch

from milepost.launch.process import free_port
from milepost.weights.bucket import BucketMeta, Named, bucket_meta
from milepost.weights.process_group import BackendName, WeightGroup, init_weight_group
from milepost.weights.transport import TransportError, _EngineFanout, _in_daemon_thread

ALIGN = 64  # every tensor starts on a 64-byte boundary of the flat buffer (dtype views need it)


def transfer_plan(num_sources: int, num_targets: int) -> list[list[int]]:
    """targets of each source: plan[s] = target indices source s writes to.

    The first min(sources, targets) map one to one; the rest of the targets are spread evenly
    over the sources in turn. Surplus sources get an empty list (they sit idle).
    """
    if num_sources < 1 or num_targets < 0:
        raise ValueError(f"transfer_plan needs >= 1 source and >= 0 targets, got "
                         f"{num_sources} and {num_targets}")
    plan: list[list[int]] = [[] for _ in range(num_sources)]
    for t in range(num_targets):
        plan[t % num_sources].append(t)
    return plan


def flat_layout(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
                ) -> tuple[list[int], int]:
    """(byte offset of each tensor, total bytes) in the packed bucket; both ends compute it."""
    offsets, pos = [], 0
    for shape, dtype in zip(shapes, dtypes):
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        numel = 1
        for d in shape:
            numel *= int(d)
        pos += numel * dtype.itemsize
    return offsets, pos


def unpack(flat: torch.Tensor, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
           ) -> list[torch.Tensor]:
    """Views of each tensor inside the packed uint8 buffer `flat` (no copy)."""
    offsets, total = flat_layout(shapes, dtypes)
    if flat.numel() < total:
        raise ValueError(f"packed bucket holds {flat.numel()} bytes, the layout needs {total}")
    out = []
    for off, shape, dtype in zip(offsets, shapes, dtypes):
        n = 1
        for d in shape:
            n *= int(d)
        out.append(flat[off:off + n * dtype.itemsize].view(dtype).view(tuple(shape)))
    return out


class P2PBackend(Protocol):
    """How bytes move from a source to one target. An RDMA backend registers `staging` once in
    `prepare` and writes into the target's registered memory in `write`."""

    def prepare(self, staging: torch.Tensor) -> None: ...

    def write(self, staging: torch.Tensor, nbytes: int, target_rank: int) -> object:
        """Start writing staging[:nbytes] to `target_rank`; returns a handle with wait()."""
        ...


class TorchP2PBackend:
    """torch.distributed send/recv over a WeightGroup (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: WeightGroup) -> None:
        self.group = group

    def prepare(self, staging: torch.Tensor) -> None:
        pass  # nothing to register with gloo / NCCL

    def write(self, staging: torch.Tensor, nbytes: int, target_rank: int) -> object:
        return self.group.send(staging[:nbytes], target_rank)


class StagingBuffer:
    """One packed-bucket buffer, grown only when a bucket is larger than any before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flat = torch.empty(0, dtype=torch.uint8, device=device)

    def pack(self, bucket: Named, meta: BucketMeta) -> int:
        dtypes = [t.dtype for _, t in bucket]
        offsets, total = flat_layout(meta.shapes, dtypes)
        if self.flat.numel() < total:
            pin = self.device.type == "cpu" and torch.cuda.is_available()
            self.flat = torch.empty(total, dtype=torch.uint8, device=self.device, pin_memory=pin)
        for off, (_, t) in zip(offsets, bucket):
            n = t.numel() * t.element_size()
            if not n:
                continue
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if self.flat.device.type == "cpu" and src.device.type == "cpu":
                # A plain memcpy: torch's copy_ splits over its OpenMP threads, whose barrier
                # costs ~1000x the copy on a host whose cores are busy (measured here).
                np.copyto(self.flat[off:off + n].numpy(), src.numpy())
            else:
                self.flat[off:off + n].copy_(src)
        return total


class P2PTransport(_EngineFanout):
    """Disaggregated engines written to point-to-point; trainer = source rank 0, engine i = rank 1+i.

    Engines answer `/update_weights_from_p2p` (milepost's endpoint; SGLang's P2P path uses an RDMA
    transfer engine this machine lacks). The metadata call reaches the engine before the bytes, so
    an engine refuses wrong names/shapes/dtypes before it writes anything.
    """

    def __init__(self, engine_urls: Sequence[str], backend: BackendName = "gloo",
                 master_address: str = "127.0.0.1", timeout_s: float = 300.0) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(engine_urls, timeout_s)
        self.backend: BackendName = backend
        self.master_address = master_address
        self.group_name = f"milepost_p2p_{uuid.uuid4().hex[:8]}"
        self.num_sources = 1
        self.plan = transfer_plan(self.num_sources, len(self.engine_urls))
        self._group: WeightGroup | None = None
        self._io: TorchP2PBackend | None = None
        self._staging: StagingBuffer | None = None
        self._tail: list[futures.Future] = []  # the last group's writes and engine answers

    def begin(self, version: str) -> None:
        super().begin(version)
        if self._group is None:
            self._group = self._guard(self._init_group)
            self._io = TorchP2PBackend(self._group)
            self._staging = StagingBuffer(self._group.device)

    def _init_group(self) -> WeightGroup:
        self._wait(self._call_all("GET", "/health"))
        port = free_port(self.master_address)
        world = self.num_sources + len(self.engine_urls)
        posts = self._post_all("/init_weights_update_group", lambda i: {
            "master_address": self.master_address, "master_port": port,
            "rank_offset": self.num_sources + i, "world_size": world,
            "group_name": self.group_name, "backend": self.backend})
        joined = _in_daemon_thread(lambda: init_weight_group(
            self.master_address, port, 0, world, self.group_name, self.backend,
            timeout_s=self.timeout_s), "p2p-group-init")
        try:
            self._wait(posts, also=[joined])
        except TransportError as e:
            joined.add_done_callback(lambda f: f.exception() or f.result().close())
            raise TransportError(f"creating p2p group {self.group_name!r} failed: {e}") from e
        return joined.result()

    def _target_groups(self, source: int) -> list[list[int]]:
        """This source's targets grouped by engine rank (tensor-parallel rank; all 0 here)."""
        by_rank: dict[int, list[int]] = {}
        for t in self.plan[source]:
            by_rank.setdefault(0, []).append(t)
        return [by_rank[r] for r in sorted(by_rank)]

    def send(self, bucket: Named, last: bool = False) -> None:
        self._check_usable()
        if self._group is None or self.version is None:
            raise TransportError("P2PTransport.send before begin(version)")
        if not bucket:
            raise ValueError("P2PTransport.send: empty bucket")
        self._drain_tail()  # the staging buffer is about to be refilled
        meta = bucket_meta(bucket)
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()
        nbytes = self._staging.pack([(n, t.to(self._group.device)) for n, t in bucket], meta)
        body = {"names": meta.names, "dtypes": meta.dtypes, "shapes": meta.shapes,
                "group_name": self.group_name, "src_rank": 0, **self._last_fields(last)}
        groups = self._target_groups(0)
        for k, targets in enumerate(groups):
            posts = [self._pool.submit(self._call, i, "POST", "/update_weights_from_p2p", body)
                     for i in targets]
            writes = _in_daemon_thread(lambda ts=targets: self._write(ts, nbytes), "p2p-write")
            if k < len(groups) - 1:
                self._guard(lambda p=posts, w=writes: self._wait(p, also=[w]))
            else:  # overlaps the caller's preparation of the next bucket
                self._tail = [*posts, writes]

    def _write(self, targets: list[int], nbytes: int) -> None:
        try:
            works = [self._io.write(self._staging.flat, nbytes, self.num_sources + t)
                     for t in targets]
            for w in works:
                w.wait()
        except Exception as e:  # torch raises several types for a lost peer
            raise TransportError(f"p2p write over {self.group_name!r} failed "
                                 f"({type(e).__name__}: {e})") from e
        if self.backend == "nccl":
            torch.cuda.synchronize()

    def _drain_tail(self) -> None:
        tail, self._tail = self._tail, []
        if tail:
            self._guard(lambda: self._wait(tail[:-1], also=tail[-1:]))

    def finish(self, version: str) -> None:
        self._check_usable()
        self._drain_tail()
        super().finish(version)

    def close(self) -> None:
        if not self._closed:
            self._leave_group(all(f.done() for f in self._tail))
        super().close()
