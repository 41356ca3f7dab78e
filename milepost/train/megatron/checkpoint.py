"""Megatron backend checkpoints: each rank's model shard, Adam state (its shard of it with the distributed
optimizer), schedule and RNG, atomically.

Same directory contract as the FSDP checkpoints, through the same staging and atomic publish
(`staged_checkpoint_dir` in milepost/train/checkpoint.py): `milepost_checkpoint.json` (written
last) marks it complete, so `latest_checkpoint` works unchanged. Files: `megatron_rank_<r>.pt`.
Resuming needs the same world size and parallel sizes (resharding one: `milepost convert`, via HF).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from milepost.train.checkpoint import (
    FORMAT_VERSION,
    META_FILE,
    _rng_state,
    _set_rng_state,
    staged_checkpoint_dir,
)


def save(path: str | Path, model: nn.Module, optimizer: Any, scheduler: Any,
         layout: dict[str, int], extra: dict[str, Any] | None = None) -> None:
    """Collective: every rank writes its own file; rank 0 renames the directory into place."""
    meta = {"format_version": FORMAT_VERSION, "world_size": dist.get_world_size(), "backend": "megatron",
            "layout": layout, "extra": dict(extra or {})}
    with staged_checkpoint_dir(path, meta) as tmp:
        state = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items() if v is not None},
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": _rng_state()}
        torch.save(state, tmp / f"megatron_rank_{dist.get_rank()}.pt")


def load(path: str | Path, model: nn.Module, optimizer: Any, scheduler: Any,
         layout: dict[str, int]) -> dict[str, Any]:
    """Collective inverse of `save`; refuses a checkpoint of another backend, world or layout."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete milepost checkpoint (no {META_FILE})")
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("backend") != "megatron":
        raise ValueError(f"{path} was written by the {meta.get('backend', 'fsdp')} backend; resume it with "
                         "--train-backend fsdp (or export it to Hugging Face and start from that)")
    world = dist.get_world_size()
    if meta["world_size"] != world or meta["layout"] != layout:
        raise ValueError(f"{path} was saved by {meta['world_size']} ranks with parallel sizes {meta['layout']}; "
                         f"this run has {world} ranks with {layout}: resume with the same sizes (and the same "
                         "--use-distributed-optimizer setting)")
    own = torch.load(path / f"megatron_rank_{dist.get_rank()}.pt", map_location="cpu", weights_only=False)
    device = next(model.parameters()).device
    model.load_state_dict({k: v.to(device) for k, v in own["model"].items()}, strict=False)
    optimizer.load_state_dict(own["optimizer"])
    scheduler.load_state_dict(own["scheduler"])
    _set_rng_state(own["rng"])
    return meta["extra"]
