"""The run config's weight transport: one place maps `--update-weight-transfer-mode` to a class."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from milepost.launch.rendezvous import NODE_ADDRESS_ENV
from milepost.lora.settings import ADAPTER_SEP, POLICY_ADAPTER
from milepost.weights.disk_transport import DiskDeltaTransport
from milepost.weights.p2p import P2PTransport
from milepost.weights.sync import WeightSync
from milepost.weights.transport import (
    BroadcastTransport,
    TensorTransport,
    WeightTransport,
)

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def make_transport(cfg: TrainConfig, engine_urls: list[str], rank: int = 0, world: int = 1
                   ) -> WeightTransport | None:
    """Trainer rank `rank`'s transport for `cfg` (validated: colocated runs always use tensor).

    Rank 0 always gets one. Under p2p every rank is a source for the engines the transfer plan
    gives it (report 4.2); under the other modes only rank 0 sends and other ranks get None.
    """
    mode = cfg.update_weight_transfer_mode
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    # Where this rank hosts its weight groups: the launcher's node address (Ray), else loopback.
    address = os.environ.get(NODE_ADDRESS_ENV, "127.0.0.1")
    if mode == "p2p":
        return P2PTransport(engine_urls, backend, address, source_rank=rank, num_sources=world)
    if rank != 0:
        return None
    if mode == "tensor":
        return TensorTransport(engine_urls)
    if mode == "broadcast":
        return BroadcastTransport(engine_urls, backend, address)
    if mode == "disk-delta":
        # Pauses the engines around the reload alone, in both loops (report 4.3).
        return DiskDeltaTransport(engine_urls, cfg.update_weight_delta_dir,
                                  cfg.update_weight_delta_encoding,
                                  pause_mode=cfg.pause_generation_mode)
    raise ValueError(f"--update-weight-transfer-mode {mode!r} is not one of tensor, broadcast, "
                     "p2p, disk-delta")


def selector_skips(cfg: TrainConfig) -> tuple[str, ...]:
    """--check-weight-update-selector as globs: target skips the MTP draft's layers, draft checks
    only them ("!glob")."""
    if cfg.check_weight_update_selector == "all":
        return ()
    from milepost.models.mtp import mtp_draft_globs

    globs = mtp_draft_globs(cfg.hf_checkpoint)
    return tuple(globs) if cfg.check_weight_update_selector == "target" else tuple("!" + g for g in globs)


def make_weight_sync(cfg: TrainConfig, engine_urls: list[str], rank: int, world: int
                     ) -> WeightSync | None:
    """Trainer rank `rank`'s WeightSync: None where this rank only takes part in the gathers."""
    transport = make_transport(cfg, engine_urls, rank, world)
    if transport is None:
        return None
    return WeightSync(transport, cfg.update_weight_buffer_size, dtype=getattr(torch, cfg.dtype),
                      check_weight_update=cfg.check_weight_update,
                      check_equal_once=cfg.check_weight_update_equal,
                      check_skip=tuple(cfg.check_weight_update_equal_skip or ()) + selector_skips(cfg),
                      scope=f"{POLICY_ADAPTER}{ADAPTER_SEP}" if cfg.lora_rank else None)
