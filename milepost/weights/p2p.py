"""Peer-to-peer weight transfer (report 4.2): trainer ranks (sources) write to engines (targets).

Several sources: every trainer rank builds a `P2PTransport(source_rank=rank, num_sources=world)`
and runs the same bucketed pipeline (`WeightSync`). `transfer_plan` gives each source its targets
(the first min(sources, targets) one to one, the rest spread evenly; surplus sources sit idle).
Under FSDP every rank gathers every full tensor anyway (the gather is a collective), so what is
spread is the sending: each engine receives every bucket exactly once, from its one planned
source, and each source only touches its own targets (its own weight group, its own engine
calls). Source 0 also coordinates: it alone randomizes engines for the equality check, and its
`finish` waits until every engine, whoever fed it, reports the new version.

Per source, as in the report: one staging buffer (pinned when CUDA is present) packed once per
bucket and reused for every target; targets grouped by engine rank, every group but the last
waiting for its writes, the last group's writes finishing while the caller prepares the next bucket.

How bytes move is a `P2PBackend` (the seam an RDMA library fills later):
- `TorchP2PBackend`: torch.distributed send/recv over a group of the source and its targets
  (gloo on CPU, NCCL on GPU);
- `CudaIpcBackend` (milepost/weights/p2p_ipc.py): when the source is on CUDA and every target
  engine runs on CUDA on this host and sees the source's GPU under the same device index, the
  engine copies out of the source's staging buffer through a CUDA IPC handle; no process group
  is formed. Chosen automatically (`ipc=None`); otherwise the group path.

Deviations, honestly: engines have one tensor-parallel rank, so every target needs every shard
and nothing is re-sharded (no CPU model replica); there is no RDMA, so over torch.distributed on
one host P2P is slower than broadcast (benchmarks/RESULTS.md), as the report also finds.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from concurrent import futures
from typing import Protocol

import torch

from milepost.launch.process import free_port
from milepost.weights.bucket import Named, bucket_meta
from milepost.weights.p2p_ipc import CudaIpcBackend, is_local_url
from milepost.weights.p2p_layout import StagingBuffer, transfer_plan
from milepost.weights.process_group import BackendName, WeightGroup, init_weight_group
from milepost.weights.transport import TransportError, _EngineFanout, _in_daemon_thread

_POLL_S = 0.02  # source 0's finish polls the engines other sources feed


class P2PBackend(Protocol):
    """How bytes move from a source to one target. An RDMA backend registers `staging` once in
    `prepare` and writes into the target's registered memory in `write`."""

    def prepare(self, staging: torch.Tensor) -> None: ...

    def request_fields(self, staging: torch.Tensor, nbytes: int) -> dict:
        """Extra fields of the bucket's engine call (a handle the engine reads from)."""
        ...

    def write(self, staging: torch.Tensor, nbytes: int, target_rank: int) -> object:
        """Start writing staging[:nbytes] to `target_rank`; returns a handle with wait()."""
        ...


class TorchP2PBackend:
    """torch.distributed send/recv over a WeightGroup (gloo on CPU, NCCL on GPU)."""

    def __init__(self, group: WeightGroup) -> None:
        self.group = group

    def prepare(self, staging: torch.Tensor) -> None:
        pass  # nothing to register with gloo / NCCL

    def request_fields(self, staging: torch.Tensor, nbytes: int) -> dict:
        return {}

    def write(self, staging: torch.Tensor, nbytes: int, target_rank: int) -> object:
        return self.group.send(staging[:nbytes], target_rank)


class P2PTransport(_EngineFanout):
    """One source's side of a P2P update; its group: this source = rank 0, its j-th target 1 + j.

    engine_urls: every engine (the same list on every source). source_rank / num_sources: this
    trainer rank and how many there are. ipc: None = CUDA IPC when possible (see module doc),
    False = never, True = required (refused at the first update when not possible).
    Engines answer `/update_weights_from_p2p` (milepost's endpoint; SGLang's P2P path uses an
    RDMA transfer engine this machine lacks). The metadata call reaches the engine before the
    bytes, so an engine refuses wrong names/shapes/dtypes before it writes anything.
    """

    def __init__(self, engine_urls: Sequence[str], backend: BackendName = "gloo",
                 master_address: str = "127.0.0.1", timeout_s: float = 300.0, *,
                 source_rank: int = 0, num_sources: int = 1, ipc: bool | None = None) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if num_sources < 1 or not 0 <= source_rank < num_sources:
            raise ValueError(f"source_rank {source_rank} must be in [0, num_sources={num_sources})")
        if ipc and backend != "nccl":
            raise ValueError("ipc=True needs backend 'nccl' (a CUDA trainer); gloo sends from CPU")
        super().__init__(engine_urls, timeout_s)
        self.backend: BackendName = backend
        self.master_address = master_address
        self.group_name = f"milepost_p2p_{uuid.uuid4().hex[:8]}_s{source_rank}"
        self.source_rank, self.num_sources = source_rank, num_sources
        self.coordinates = source_rank == 0  # WeightSync: randomizes and checks on this one only
        self.plan = transfer_plan(num_sources, len(self.engine_urls))
        self.targets = self.plan[source_rank]
        self.ipc = ipc
        self.path: str | None = None  # "cuda-ipc", "gloo" or "nccl" once begun; None when idle
        self.bytes_sent = 0  # bytes this source wrote, summed over its targets
        self._device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                        else torch.device("cpu"))
        self._io: P2PBackend | None = None
        self._group: WeightGroup | None = None
        self._tail_targets: list[int] = []
        self._staging: StagingBuffer | None = None
        self._tail: list[futures.Future] = []  # the last group's writes and engine answers

    def begin(self, version: str) -> None:
        super().begin(version)
        if self._io is None and self.targets:
            self._io = self._guard(self._connect)
            self._staging = StagingBuffer(self._device)

    def _connect(self) -> P2PBackend:
        why_not = "forbidden (ipc=False)" if self.ipc is False else self._why_not_ipc()
        if self.ipc and why_not:
            raise TransportError(f"P2PTransport(ipc=True): CUDA IPC is not possible: {why_not}")
        if self.ipc is not False and not why_not:
            self.path = "cuda-ipc"
            return CudaIpcBackend()
        self._group = self._init_group()
        self.path = self.backend
        return TorchP2PBackend(self._group)

    def _why_not_ipc(self) -> str:
        """Why CUDA IPC cannot reach every target ("" when it can)."""
        if self.backend != "nccl":
            return "the trainer's side is not CUDA (backend gloo)"
        remote = [self.engine_urls[t] for t in self.targets if not is_local_url(self.engine_urls[t])]
        if remote:
            return f"engines on another host: {', '.join(remote)}"
        try:
            infos = self._wait(self._call_all("GET", "/weights_p2p_info", indices=self.targets),
                               indices=self.targets)
        except TransportError as e:  # an engine without the endpoint (SGLang) or not answering
            return f"the engines' GPUs are unknown ({e})"
        cpu = [self.engine_urls[t] for t, info in zip(self.targets, infos)
               if not str(info.get("device", "")).startswith("cuda")]
        if cpu:
            return f"engines not on CUDA: {', '.join(cpu)}"
        # A handle opens on the sender's device index: the engine must see this very GPU there
        # (engines given their own GPUs by CUDA_VISIBLE_DEVICES do not: they get NCCL).
        index = self._device.index
        mine = str(torch.cuda.get_device_properties(index).uuid)
        blind = [self.engine_urls[t] for t, info in zip(self.targets, infos)
                 if index >= len(info.get("cuda_uuids", [])) or info["cuda_uuids"][index] != mine]
        return (f"engines that do not see this trainer's GPU (cuda:{index}) under the same index: "
                f"{', '.join(blind)}") if blind else ""

    def _init_group(self) -> WeightGroup:
        port = free_port(self.master_address)
        world = 1 + len(self.targets)
        rank_of = {t: 1 + j for j, t in enumerate(self.targets)}
        posts = self._post_all("/init_weights_update_group", lambda i: {
            "master_address": self.master_address, "master_port": port,
            "rank_offset": rank_of[i], "world_size": world,
            "group_name": self.group_name, "backend": self.backend}, self.targets)
        joined = _in_daemon_thread(lambda: init_weight_group(
            self.master_address, port, 0, world, self.group_name, self.backend,
            timeout_s=self.timeout_s), "p2p-group-init")
        try:
            self._wait(posts, also=[joined], indices=self.targets)
        except TransportError as e:
            joined.add_done_callback(lambda f: f.exception() or f.result().close())
            raise TransportError(f"creating p2p group {self.group_name!r} failed: {e}") from e
        return joined.result()

    def _target_groups(self) -> list[list[int]]:
        """This source's targets grouped by engine rank (tensor-parallel rank; all 0 here)."""
        by_rank: dict[int, list[int]] = {}
        for t in self.targets:
            by_rank.setdefault(0, []).append(t)
        return [by_rank[r] for r in sorted(by_rank)]

    def send(self, bucket: Named, last: bool = False) -> None:
        self._check_usable()
        if self.version is None:
            raise TransportError("P2PTransport.send before begin(version)")
        if not bucket:
            raise ValueError("P2PTransport.send: empty bucket")
        if not self.targets:
            return  # a surplus source: the plan gives it no engine
        self._drain_tail()  # the staging buffer is about to be refilled
        meta = bucket_meta(bucket)
        if self._device.type == "cuda":  # casts queued on the current stream come first
            torch.cuda.current_stream().synchronize()
        nbytes = self._staging.pack([(n, t.to(self._device)) for n, t in bucket], meta)
        body = {"names": meta.names, "dtypes": meta.dtypes, "shapes": meta.shapes,
                "group_name": self.group_name, "src_rank": 0,
                **self._io.request_fields(self._staging.flat, nbytes), **self._last_fields(last)}
        groups = self._target_groups()
        for k, targets in enumerate(groups):
            posts = self._post_all("/update_weights_from_p2p", lambda i: body, targets)
            writes = _in_daemon_thread(lambda ts=targets: self._write(ts, nbytes), "p2p-write")
            self.bytes_sent += nbytes * len(targets)
            if k < len(groups) - 1:
                self._guard(lambda p=posts, w=writes, ts=targets: self._wait(p, also=[w], indices=ts))
            else:  # overlaps the caller's preparation of the next bucket
                self._tail = [*posts, writes]
                self._tail_targets = targets

    def _write(self, targets: list[int], nbytes: int) -> None:
        rank_of = {t: 1 + j for j, t in enumerate(self.targets)}
        try:
            works = [self._io.write(self._staging.flat, nbytes, rank_of[t]) for t in targets]
            for w in works:
                w.wait()
        except Exception as e:  # torch raises several types for a lost peer
            raise TransportError(f"p2p write over {self.group_name!r} failed "
                                 f"({type(e).__name__}: {e})") from e
        if self.path == "nccl":
            torch.cuda.synchronize()

    def _drain_tail(self) -> None:
        tail, self._tail = self._tail, []
        if tail:
            self._guard(lambda: self._wait(tail[:-1], also=tail[-1:], indices=self._tail_targets))

    def finish(self, version: str) -> None:
        """This source's targets must report `version`; source 0 then waits for every engine."""
        self._check_usable()
        if version != self.version:
            raise ValueError(f"finish({version!r}) does not match begin({self.version!r})")
        self._drain_tail()
        if self.targets and not self._version_sent:
            self._guard(lambda: self._wait(self._post_all(
                "/update_weight_version", lambda i: {"new_version": version}, self.targets),
                indices=self.targets))
        others = [i for i in range(len(self.engine_urls)) if i not in self.targets]
        self._require_version(self.targets, version, deadline=None)
        if self.coordinates and others:
            self._require_version(others, version, deadline=time.monotonic() + self.timeout_s)

    def _require_version(self, indices: list[int], version: str, deadline: float | None) -> None:
        """Every engine of `indices` reports `version`; polled until `deadline` when other
        sources feed them (they answer their last bucket whenever their source gets there)."""
        while indices:
            answers = self._guard(lambda: self._wait(
                self._call_all("GET", "/get_weight_version", indices=indices), indices=indices))
            wrong = [(i, a.get("weight_version")) for i, a in zip(indices, answers)
                     if a.get("weight_version") != version]
            if not wrong:
                return
            if deadline is None or time.monotonic() > deadline:
                sources = {i: s for s, ts in enumerate(self.plan) for i in ts}
                self._break("after the update " + "; ".join(
                    f"engine {i} ({self.engine_urls[i]}, fed by trainer rank {sources[i]}) "
                    f"reports weight_version {v!r}" for i, v in wrong) + f", expected {version!r}")
            time.sleep(_POLL_S)

    def close(self) -> None:
        if not self._closed:
            self._leave_group(all(f.done() for f in self._tail), self.targets)
        super().close()
