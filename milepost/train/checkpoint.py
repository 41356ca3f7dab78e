"""Training checkpoints: model + optimizer (torch.distributed.checkpoint), scheduler, RNG, extra.

Layout of one checkpoint directory: DCP shards and `.metadata` (any world size can load them),
`rank_<r>.pt` (scheduler and that rank's torch / CUDA / python / numpy RNG states) and
`milepost_checkpoint.json` (world size and the caller's JSON `extra`: step, data-source state...).
A save is atomic: everything goes into `<dir>.tmp-<pid>`, is fsynced, then renamed into place, so
a crash mid-save leaves earlier checkpoints (and a previous save at the same path) intact.
When to save is the driver's call; `checkpoint_path` / `latest_checkpoint` fix where.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from milepost.train.optim_stream import StreamingAdamW

META_FILE = "milepost_checkpoint.json"
STREAM_DIR = "optimizer_stream"  # --stream-optimizer-state-to-disk: each rank's moment files
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint taken after optimizer/rollout step `step` of a run lives."""
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint of `run_dir` with the highest step, or None (half-written ones never count)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and (p / META_FILE).is_file()]
    return max(done, key=lambda p: int(_STEP_DIR.fullmatch(p.name).group(1)), default=None)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


@contextlib.contextmanager
def staged_checkpoint_dir(path: str | Path, meta: dict[str, Any]) -> Iterator[Path]:
    """Collective: every rank writes its files into the yielded temporary directory; then
    `publish_checkpoint_dir` puts it at `path` (both backends' checkpoints go through here)."""
    try:
        text = json.dumps(meta)
    except TypeError as e:
        raise TypeError(f"checkpoint extra must be JSON-serializable (step, data state, ...): {e}") from e
    path = Path(path).absolute()
    names = [f"{path.name}.tmp-{os.getpid()}"]
    dist.broadcast_object_list(names, src=0)  # one temp dir for all ranks: rank 0's pid names it
    tmp = path.parent / names[0]
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f"{path.name}.tmp-*"):
            shutil.rmtree(stale)
        tmp.mkdir()
    dist.barrier()
    yield tmp
    dist.barrier()
    if dist.get_rank() == 0:
        publish_checkpoint_dir(tmp, path, text)
    dist.barrier()


def publish_checkpoint_dir(tmp: Path, path: Path, meta: str) -> None:
    """Make the complete directory `tmp` the checkpoint at `path`, atomically (one process).

    META_FILE is written last (it marks a checkpoint complete), everything is fsynced, a previous
    checkpoint at `path` is renamed aside before `tmp` takes its name and removed only after: a
    crash at any point leaves one complete checkpoint at `path` or beside it."""
    (tmp / META_FILE).write_text(meta)
    _fsync_tree(tmp)
    old = path.parent / f"{path.name}.old-{os.getpid()}"
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    _fsync(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _options(model: nn.Module) -> StateDictOptions:
    """A model with frozen parameters (a LoRA adapter on its base) saves and loads only the
    trained ones: the frozen base is the checkpoint it was loaded from, never changed."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP saves: the model, and the optimizer unless its state streams from its own files."""
    if isinstance(optimizer, StreamingAdamW):
        return {"model": get_model_state_dict(model, options=_options(model))}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    extra: dict[str, Any] | None = None,
    stateful: dict[str, Any] | None = None,
) -> None:
    """Collective: every rank calls it with its own (sharded) model and optimizer. `stateful`:
    other trainer state (objects with state_dict / load_state_dict, e.g. the FP8 amax history),
    kept in each rank's file beside the scheduler."""
    meta = {"format_version": FORMAT_VERSION, "world_size": dist.get_world_size(), "extra": dict(extra or {})}
    with staged_checkpoint_dir(path, meta) as tmp:
        dcp.save(_state(model, optimizer), checkpoint_id=tmp)
        if isinstance(optimizer, StreamingAdamW):  # its moments are files: copied, per rank
            optimizer.save_files(tmp / STREAM_DIR / f"rank_{dist.get_rank()}")
        torch.save({"scheduler": scheduler.state_dict(), "rng": _rng_state(),
                    "stateful": {k: v.state_dict() for k, v in (stateful or {}).items()}},
                   tmp / f"rank_{dist.get_rank()}.pt")


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    stateful: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collective inverse of `save_checkpoint`; returns the saved `extra`. Each `stateful` object
    missing from the checkpoint (saved without it) keeps its fresh state, with a warning.

    Model and optimizer reshard to the current world size; RNG states are restored only when the
    world size matches the one that saved (a warning otherwise: the trainer itself draws no random
    numbers, but a caller relying on them should know).
    """
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete milepost checkpoint (no {META_FILE})")
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {meta.get('format_version')}, this milepost reads {FORMAT_VERSION}")
    rank, world = dist.get_rank(), dist.get_world_size()
    same_layout = meta["world_size"] == world
    streamed = (path / STREAM_DIR).is_dir()
    if isinstance(optimizer, StreamingAdamW):
        if streamed and not same_layout:
            raise ValueError(f"{path} streamed its optimizer state from {meta['world_size']} "
                             f"trainer ranks; --stream-optimizer-state-to-disk resumes only on the "
                             f"same layout, not {world} ranks")
        optimizer.load_files(path / STREAM_DIR / f"rank_{rank}")  # refuses a non-streamed one
    elif streamed:
        raise ValueError(f"{path} was written with --stream-optimizer-state-to-disk: resume it with "
                         "that setting (its Adam moments are in files, not in the checkpoint)")
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    if isinstance(optimizer, StreamingAdamW):
        set_model_state_dict(model, state["model"], options=_options(model))
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=_options(model))
    own = torch.load(path / f"rank_{rank if same_layout else 0}.pt", weights_only=False)
    scheduler.load_state_dict(own["scheduler"])
    for key, obj in (stateful or {}).items():
        if key in own.get("stateful", {}):
            obj.load_state_dict(own["stateful"][key])
        elif rank == 0:
            warnings.warn(f"{path} has no {key} state (saved without it): it starts fresh")
    if same_layout:
        _set_rng_state(own["rng"])
    elif rank == 0:
        warnings.warn(f"{path} was saved by {meta['world_size']} ranks, loaded by {world}: RNG states not restored")
    return meta["extra"]
