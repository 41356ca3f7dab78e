"""The CUDA IPC path of peer-to-peer weight transfer: source and target share a host and CUDA.

Instead of sending bytes over a process group, the source hands each target a CUDA IPC handle to
its packed staging buffer inside the bucket's engine call (`ipc_handle`, built with torch's own
`reduce_tensor`); the engine opens it, copies the bucket into its own memory device-to-device and
answers after the copy completed, so the source may refill the buffer as soon as every target
answered. The same `P2PBackend` seam as the process-group path: `write` has nothing left to do,
the handle travels in `request_fields`.

Selected by P2PTransport when the trainer's side is CUDA and every target engine runs on CUDA on
this host (its URL resolves to a local address). Both processes must see the source's GPU under
the same device index (as for the in-host tensor handoff).
"""

from __future__ import annotations

import functools
import socket
from urllib.parse import urlsplit

import torch

from milepost.weights.codec import (
    WeightUpdateError,
    deserialize_named_tensors,
    serialize_named_tensors,
)

_STAGING = "p2p_staging"  # the single name the handle travels under


@functools.lru_cache(maxsize=1)
def _local_addresses() -> frozenset[str]:
    addrs = {"127.0.0.1", "::1", "localhost"}
    for host in {socket.gethostname(), socket.getfqdn()}:
        try:
            addrs |= {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            pass  # a host name that does not resolve: loopback still counts
    return frozenset(addrs)


def is_local_url(url: str) -> bool:
    """True when `url`'s host is this machine (loopback or one of its own addresses)."""
    host = urlsplit(url).hostname or ""
    if host in _local_addresses() or host.startswith("127."):
        return True
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(resolved & _local_addresses()) or any(a.startswith("127.") for a in resolved)


class _Done:
    """The handle of a write that already happened (the engine pulls during its call)."""

    def wait(self) -> None:
        pass


class CudaIpcBackend:
    """Hands the staging buffer to targets by CUDA IPC handle; the engine copies out of it."""

    def prepare(self, staging: torch.Tensor) -> None:
        if not staging.is_cuda:
            raise ValueError(f"the CUDA IPC path needs a CUDA staging buffer, got {staging.device}")

    def request_fields(self, staging: torch.Tensor, nbytes: int) -> dict:
        # The packing copies ran on the current stream; the engine reads from another process.
        torch.cuda.current_stream(staging.device).synchronize()
        return {"ipc_handle": serialize_named_tensors([(_STAGING, staging[:nbytes])])}

    def write(self, staging: torch.Tensor, nbytes: int, target_rank: int) -> object:
        return _Done()


def receive_ipc_bucket(ipc_handle: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """Open the source's staging buffer and copy its first `nbytes` into a new buffer on `device`.

    Returns after the copy completed, so the source may reuse its buffer once this call's engine
    request answered. Refuses a handle that does not name a CUDA uint8 buffer of >= nbytes.
    """
    if device.type != "cuda":
        raise WeightUpdateError(f"a CUDA IPC bucket needs an engine on CUDA, this one runs on "
                                f"{device}; use the process-group path (P2PTransport(ipc=False))")
    named = deserialize_named_tensors(ipc_handle)
    if len(named) != 1 or named[0][0] != _STAGING:
        raise WeightUpdateError(f"ipc_handle must carry one {_STAGING!r} buffer, got "
                                f"{[n for n, _ in named]}")
    remote = named[0][1]
    if not remote.is_cuda or remote.dtype != torch.uint8 or remote.dim() != 1:
        raise WeightUpdateError(f"ipc_handle must name a 1-d CUDA uint8 buffer, got "
                                f"{remote.dtype} {list(remote.shape)} on {remote.device}")
    if remote.numel() < nbytes:
        raise WeightUpdateError(f"ipc_handle buffer holds {remote.numel()} bytes, the bucket's "
                                f"layout needs {nbytes}")
    local = torch.empty(nbytes, dtype=torch.uint8, device=device)
    local.copy_(remote[:nbytes])
    torch.cuda.current_stream(device).synchronize()
    del remote, named  # drop the mapping of the source's memory now, not at collection
    return local
