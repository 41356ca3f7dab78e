"""Rendezvous stores that listen on one address, not on every interface.

torch's TCPStore server binds all interfaces whatever host it is given; a socket bound to the
one address first and handed over (`master_listen_fd`) keeps the trainer's rendezvous, and the
trainer-to-engine weight groups, on loopback when the run is on one host. The local launcher
also pins gloo and NCCL's own sockets to loopback (`LOOPBACK_SOCKET_ENV`).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the launcher reads the constants below without torch
    import torch.distributed as dist

# gloo and NCCL pick their listening interface from these; "lo" is Linux's loopback interface.
LOOPBACK_SOCKET_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
# Set by a launcher that places ranks on several hosts (Ray): the address of this rank's node,
# where its weight groups listen (engines on other nodes join there). Unset: loopback.
NODE_ADDRESS_ENV = "MILEPOST_NODE_ADDRESS"


def bound_store(host: str, port: int, world_size: int, is_server: bool,
                timeout: timedelta) -> dist.TCPStore:
    """A TCPStore at host:port; the server side listens on `host` only (never 0.0.0.0)."""
    import torch.distributed as dist

    if not is_server:
        return dist.TCPStore(host, port, world_size, False, timeout)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    # detach: the store owns the descriptor from here (the socket object would close it).
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def init_default_group(backend: str, timeout_s: float = 1800.0) -> None:
    """`dist.init_process_group` from the launcher's environment (MASTER_ADDR, MASTER_PORT,
    RANK, WORLD_SIZE), with rank 0's store listening on MASTER_ADDR only."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    store = bound_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                        rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
