"""A torch.distributed group between a trainer (rank 0) and engine ranks, for weight broadcast.

It is built from a TCPStore and a directly constructed ProcessGroupGloo / ProcessGroupNCCL, so it
neither needs nor touches the default process group of either side (the trainer keeps its own
FSDP group). Store keys follow the layout of SGLang's `init_custom_process_group` for NCCL, so a
trainer using this can rendezvous with a real SGLang engine (not testable here: no SGLang).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from milepost.launch.rendezvous import bound_store
from milepost.weights.codec import WeightUpdateError

BackendName = Literal["gloo", "nccl"]

# Gloo refuses some dtypes (float8 variants: "Invalid scalar type"); those travel as raw bytes.
# Both ends apply the same rule to the same dtype, so the bytes on the wire always match.
_GLOO_NATIVE_DTYPES = frozenset(
    [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool]
    + [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
)


class WeightGroup:
    """One member's handle on a weight-broadcast group; close it (or use `with`) when done."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        backend: BackendName,
        store: dist.Store,
        pg: dist.ProcessGroupGloo,  # or ProcessGroupNCCL; both expose broadcast(tensors, opts)
    ) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend: BackendName = backend
        self._store: dist.Store | None = store
        self._pg = pg

    @property
    def device(self) -> torch.device:
        """Where tensors for this group must live: CPU for gloo, the current CUDA device for nccl."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def closed(self) -> bool:
        return self._pg is None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite `tensor` on every rank with `src`'s `tensor`, in place; returns when done.

        For nccl "done" means ordered on the current CUDA stream, as for any torch collective.
        """
        self.broadcast_many([tensor], src=src)

    def broadcast_many(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Broadcast several tensors from `src`: all are issued at once, then all are awaited.

        Every rank must pass tensors of the same shapes and dtypes in the same order.
        """
        if self._pg is None:
            raise WeightUpdateError(f"weight group {self.name!r} is closed; init it again")
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src={src} is outside group {self.name!r} of size {self.world_size}")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        pending = []
        for tensor in tensors:
            self._check_device(tensor)
            if tensor.numel() == 0:
                continue  # every rank knows the shape; nothing to move
            wire = tensor if tensor.is_contiguous() else tensor.contiguous()
            payload = wire
            if self.backend == "gloo" and wire.dtype not in _GLOO_NATIVE_DTYPES:
                payload = wire.reshape(-1).view(torch.uint8)  # a view: bytes land in `wire`
            work = self._pg.broadcast([payload], opts)
            pending.append((work, tensor, wire))
        for work, tensor, wire in pending:
            work.wait()
            if wire is not tensor and self.rank != src:
                tensor.copy_(wire)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> dist.Work:
        """Start a point-to-point send of contiguous `tensor` to rank `dst`; wait on the result."""
        return self._p2p(tensor, dst, tag, send=True)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> dist.Work:
        """Start receiving into contiguous `tensor` from rank `src`; wait on the result."""
        return self._p2p(tensor, src, tag, send=False)

    def _p2p(self, tensor: torch.Tensor, peer: int, tag: int, send: bool) -> dist.Work:
        if self._pg is None:
            raise WeightUpdateError(f"weight group {self.name!r} is closed; init it again")
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"peer rank {peer} is not another member of group {self.name!r} "
                             f"(size {self.world_size}, this rank {self.rank})")
        if not tensor.is_contiguous():
            raise ValueError("point-to-point transfers need a contiguous tensor")
        self._check_device(tensor)
        op = self._pg.send if send else self._pg.recv
        return op([tensor], peer, tag)

    def _check_device(self, tensor: torch.Tensor) -> None:
        if self.backend == "nccl" and not tensor.is_cuda:
            raise ValueError(
                f"weight group {self.name!r} uses nccl: tensors must be on CUDA, got {tensor.device}"
            )
        if self.backend == "gloo" and tensor.device.type != "cpu":
            raise ValueError(
                f"weight group {self.name!r} uses gloo: tensors must be on CPU, got {tensor.device}"
            )

    def close(self) -> None:
        """Tear down the communicator and the store (freeing rank 0's port). Idempotent."""
        pg, self._pg = self._pg, None
        self._store = None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # a peer that already left makes shutdown complain; we are leaving too

    def __enter__(self) -> WeightGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"WeightGroup({self.name!r}, rank={self.rank}/{self.world_size}, {self.backend}, {state})"


def init_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: BackendName,
    timeout_s: float = 600,
    setup_timeout_s: float | None = None,
) -> WeightGroup:
    """Join (rank 0: host) the weight group at master_address:master_port; blocks until all join.

    Rank 0 is the trainer and runs the TCP store on master_port; engine ranks are
    `rank_offset + tp_rank` in SGLang's `/init_weights_update_group` terms. All `world_size`
    members must reach the store within `setup_timeout_s` (default: `timeout_s`, which bounds
    every later collective), so callers start it concurrently on every side.
    """
    if backend not in ("gloo", "nccl"):
        raise WeightUpdateError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise WeightUpdateError(
            f"weight group {group_name!r}: rank {rank} is outside world_size {world_size} "
            "(engine rank = rank_offset + tp_rank; the trainer is rank 0)"
        )
    if not 0 < master_port < 65536:
        raise WeightUpdateError(f"weight group {group_name!r}: master_port {master_port} is not a TCP port")
    if not group_name:
        raise WeightUpdateError("weight group needs a non-empty group_name")
    if timeout_s <= 0:
        raise WeightUpdateError(f"weight group {group_name!r}: timeout_s must be > 0, got {timeout_s}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise WeightUpdateError(
            f"weight group {group_name!r}: backend 'nccl' needs CUDA and an NCCL build of torch; "
            "use backend 'gloo' on CPU"
        )
    timeout = timedelta(seconds=timeout_s)
    setup = timedelta(seconds=setup_timeout_s or timeout_s)
    try:
        # The trainer's store listens on master_address only (loopback on one host).
        tcp = bound_store(master_address, master_port, world_size, rank == 0, setup)
    except Exception as e:  # rendezvous failures surface as several torch error types
        role = "host the store on" if rank == 0 else "reach the store at"
        raise RuntimeError(
            f"weight group {group_name!r}: rank {rank} could not {role} "
            f"{master_address}:{master_port} within {setup.total_seconds():g}s ({e})"
        ) from e
    # The same nesting torch's _new_process_group_helper applies under SGLang's
    # init_custom_process_group: PrefixStore(group_name) / "<group_name>/" / "<device>/".
    device_prefix = "cuda/" if backend == "nccl" else "cpu/"
    group_store = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, tcp))
    store = dist.PrefixStore(device_prefix, group_store)
    if backend == "gloo":
        try:  # gloo connects every pair now; a member with another group_name never shows up
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        except Exception as e:
            raise RuntimeError(
                f"weight group {group_name!r}: rank {rank} could not connect to all {world_size} "
                f"members within {timeout_s}s; do all use the same group_name and world_size? ({e})"
            ) from e
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout  # what torch itself sets; there is no public setter
        # The NCCL communicator is created lazily by the first broadcast, on that tensor's device.
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return WeightGroup(group_name, rank, world_size, backend, tcp, pg)


class WeightGroupRegistry:
    """The engine's open weight groups by group_name (SGLang allows several); thread-safe."""

    def __init__(self) -> None:
        self._groups: dict[str, WeightGroup] = {}
        self._lock = threading.Lock()

    def init(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: BackendName,
        timeout_s: float = 600,
        setup_timeout_s: float | None = None,
    ) -> WeightGroup:
        """`init_weight_group` and remember the result; a name already open is refused. A name
        is reserved while its rendezvous blocks, and freed when it fails (by setup_timeout_s)."""
        with self._lock:
            if group_name in self._groups:
                raise WeightUpdateError(
                    f"weight group {group_name!r} is already open; destroy it first or pick another name"
                )
            # Reserve the name while rendezvous blocks, so a concurrent init of it fails fast.
            self._groups[group_name] = None  # type: ignore[assignment]
        try:
            group = init_weight_group(
                master_address, master_port, rank, world_size, group_name, backend, timeout_s,
                setup_timeout_s,
            )
        except BaseException:
            with self._lock:
                self._groups.pop(group_name, None)
            raise
        with self._lock:
            self._groups[group_name] = group
        return group

    def get(self, group_name: str) -> WeightGroup:
        with self._lock:
            group = self._groups.get(group_name)
            open_names = sorted(n for n, g in self._groups.items() if g is not None)
        if group is None:
            raise WeightUpdateError(
                f"no weight group named {group_name!r} (open: {open_names or 'none'}); "
                "call /init_weights_update_group first"
            )
        return group

    def names(self) -> list[str]:
        with self._lock:
            return sorted(n for n, g in self._groups.items() if g is not None)

    def destroy(self, group_name: str) -> None:
        group = self.get(group_name)
        with self._lock:
            self._groups.pop(group_name, None)
        group.close()

    def close(self) -> None:
        """Close every open group."""
        with self._lock:
            groups = [g for g in self._groups.values() if g is not None]
            self._groups.clear()
        for group in groups:
            group.close()
