"""The run config's weight transport: one place maps `--update-weight-transfer-mode` to a class."""

from __future__ import annotations

from typing import TYPE_CHECKING

from milepost.weights.disk_transport import DiskDeltaTransport
from milepost.weights.p2p import P2PTransport
from milepost.weights.transport import (
    BroadcastTransport,
    TensorTransport,
    WeightTransport,
)

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def make_transport(cfg: TrainConfig, engine_urls: list[str]) -> WeightTransport:
    """The rank-0 transport for `cfg` (validated: colocated runs always use tensor)."""
    mode = cfg.update_weight_transfer_mode
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if mode == "tensor":
        return TensorTransport(engine_urls)
    if mode == "broadcast":
        return BroadcastTransport(engine_urls, backend)
    if mode == "p2p":
        return P2PTransport(engine_urls, backend)
    if mode == "disk-delta":
        # Pauses the engines around the reload alone, in both loops (report 4.3).
        return DiskDeltaTransport(engine_urls, cfg.update_weight_delta_dir,
                                  cfg.update_weight_delta_encoding,
                                  pause_mode=cfg.pause_generation_mode)
    raise ValueError(f"--update-weight-transfer-mode {mode!r} is not one of tensor, broadcast, "
                     "p2p, disk-delta")
