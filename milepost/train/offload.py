"""Evict the paused trainer's tensors from the device and bring them back (report section 3.2).

`--offload-train`: between training steps the actor's weights, gradients and optimizer state
(and the reference / critic models when there are any) leave the device together, so a colocated
engine can use the memory; they come back, bit for bit, before the next step.

The tensors stay the same Python objects: each one's *storage* is copied out and then resized to
zero bytes, and on restore resized back and refilled. FSDP's sharded parameters, their views
and the optimizer's references therefore all stay valid, with nothing to re-register.

Destinations: `host` (pinned memory on GPU machines, so the copies run at full PCIe speed) or
`disk` (one file per rank, streamed through one fixed-size staging buffer, so host memory stays
bounded by the buffer whatever the model's size). Everything is copied out before any storage is
freed: a full disk or an unwritable directory raises with nothing lost.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch.distributed.tensor import DTensor

Destination = Literal["host", "disk"]
DEFAULT_SLOT = "trainer"


@dataclass(frozen=True)
class MoveStats:
    bytes: int
    seconds: float


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateEvictor:
    """Holds the evicted storages of one rank; `evict` then `restore`, any number of times.

    Slots keep independent sets apart (the actor and the critic take turns on the device within
    a PPO step): each slot is evicted and restored on its own, with its own file on disk, and all
    share the one staging buffer.
    """

    def __init__(self, destination: Destination, device: torch.device, *,
                 directory: str | Path | None = None, staging_bytes: int = 64 << 20) -> None:
        if destination not in ("host", "disk"):
            raise ValueError(f"--offload-train-destination must be host or disk, got {destination!r}")
        if destination == "disk" and directory is None:
            raise ValueError("--offload-train-destination disk needs --offload-train-dir")
        if staging_bytes < 1:
            raise ValueError(f"--offload-staging-bytes must be >= 1, got {staging_bytes}")
        self.destination = destination
        self.device = device
        self.directory = None if directory is None else Path(directory)
        self.staging_bytes = staging_bytes
        self._pin = device.type == "cuda"
        self._staging: torch.Tensor | None = None
        self._evicted: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        # Pinned copies stay allocated between evictions (cudaHostAlloc runs at ~1 GB/s; the
        # sizes repeat every step). Unpinned (CPU) copies are dropped: keeping them would only
        # double the host memory.
        self._host: dict[str, list[torch.Tensor]] = {}

    @property
    def evicted(self) -> bool:
        return bool(self._evicted)

    def holds(self, slot: str = DEFAULT_SLOT) -> bool:
        """Whether `slot` is evicted now."""
        return slot in self._evicted

    def file(self, slot: str = DEFAULT_SLOT) -> Path | None:
        if self.directory is None:
            return None
        name = f"rank{_rank()}.bin" if slot == DEFAULT_SLOT else f"rank{_rank()}-{slot}.bin"
        return self.directory / name

    def evict(self, tensors: Iterable[torch.Tensor], slot: str = DEFAULT_SLOT) -> MoveStats:
        """Copy out, then free, every distinct storage of `tensors` that lives on the device."""
        if slot in self._evicted:
            raise RuntimeError(f"StateEvictor.evict: {slot!r} already evicted; restore first")
        t0 = time.perf_counter()
        storages = _distinct_storages(tensors, self.device)
        if self.destination == "host":
            self._host[slot] = self._to_host(storages, self._host.get(slot, []))
        else:
            self._write(storages, slot)
        for s, _ in storages:  # only now: a failed copy above has freed nothing
            s.resize_(0)
        self._evicted[slot] = storages
        return MoveStats(sum(n for _, n in storages), time.perf_counter() - t0)

    def restore(self, slot: str = DEFAULT_SLOT) -> MoveStats:
        """Give every evicted storage of `slot` its bytes back, exactly as they were."""
        t0 = time.perf_counter()
        storages = self._evicted.pop(slot, [])
        for s, n in storages:
            s.resize_(n)
        if self.destination == "host" and storages:
            for (s, _), host in zip(storages, self._host[slot]):
                _as_bytes(s).copy_(host, non_blocking=self._pin)
            if self._pin:
                torch.cuda.synchronize(self.device)
            else:
                del self._host[slot]
        elif storages:
            self._read(storages, slot)
        return MoveStats(sum(n for _, n in storages), time.perf_counter() - t0)

    def _to_host(self, storages: list[tuple[torch.UntypedStorage, int]],
                 kept: list[torch.Tensor]) -> list[torch.Tensor]:
        reuse = [h.numel() for h in kept] == [n for _, n in storages]
        host = kept if reuse else [torch.empty(n, dtype=torch.uint8, pin_memory=self._pin)
                                   for _, n in storages]
        for (s, _), h in zip(storages, host):
            h.copy_(_as_bytes(s), non_blocking=self._pin)
        if self._pin:
            torch.cuda.synchronize(self.device)  # every copy landed before any storage is freed
        return host

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8, pin_memory=self._pin)
        return self._staging

    def _write(self, storages: list[tuple[torch.UntypedStorage, int]], slot: str) -> None:
        path = self.file(slot)
        assert path is not None
        staging = self._staging_buffer()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                for s, n in storages:
                    src = _as_bytes(s)
                    for off in range(0, n, self.staging_bytes):
                        k = min(self.staging_bytes, n - off)
                        staging[:k].copy_(src[off:off + k])
                        f.write(memoryview(staging[:k].numpy()))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # a partial file holds nothing anyone will read
            raise OSError(f"--offload-train-destination disk: cannot write {path} ({e}); "
                          "nothing was offloaded, the trainer state is intact. Free space or "
                          "point --offload-train-dir at a writable node-local disk") from e

    def _read(self, storages: list[tuple[torch.UntypedStorage, int]], slot: str) -> None:
        path = self.file(slot)
        assert path is not None
        staging = self._staging_buffer()
        view = staging.numpy()
        with open(path, "rb") as f:
            for s, n in storages:
                dst = _as_bytes(s)
                for off in range(0, n, self.staging_bytes):
                    k = min(self.staging_bytes, n - off)
                    if f.readinto(memoryview(view[:k])) != k:
                        raise RuntimeError(f"{path} ended early: the offloaded trainer state "
                                           "was truncated by something outside milepost")
                    dst[off:off + k].copy_(staging[:k])
        path.unlink()


def trainer_tensors(modules: Iterable[torch.nn.Module | None],
                    optimizers: Iterable[torch.optim.Optimizer | None]) -> list[torch.Tensor]:
    """Parameters, gradients and optimizer state of the given modules and optimizers."""
    out: list[torch.Tensor] = []
    for m in modules:
        if m is None:
            continue
        for p in m.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
    for opt in optimizers:
        if opt is None:
            continue
        out += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return out


def _distinct_storages(tensors: Iterable[torch.Tensor], device: torch.device
                       ) -> list[tuple[torch.UntypedStorage, int]]:
    seen: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for t in tensors:
        local = t._local_tensor if isinstance(t, DTensor) else t  # the shard's own storage
        if local.device.type != device.type:
            continue
        s = local.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = (s, s.nbytes())
    return list(seen.values())


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
