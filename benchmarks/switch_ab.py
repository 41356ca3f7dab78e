"""What the engine A/B scripts share (overlap_mixed_ab.py, top_p_engine_ab.py): an engine on random
weights of a shape, and runs of a switch on and off in turn, each side's medians compared."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from milepost.bench.models import native_model
from milepost.engine.engine import Engine
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.models.base import CausalLM


def started_engine(shape: str, **flags: object) -> tuple[Engine, CausalLM]:
    """An engine thread on random weights of `shape`: bf16 on CUDA with 256 running requests, fp32
    on CPU with 16 (a check that the script runs)."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    native, cfg_dir = native_model(None, shape, torch.bfloat16 if cuda else torch.float32, dev, 0)
    args = ServerArgs(model_path=cfg_dir, device=dev.type, dtype="bfloat16" if cuda else "float32",
                      max_running_requests=256 if cuda else 16, random_seed=0, **flags).resolved()
    engine = build_engine(args, model=native)[0]
    engine.start()
    return engine, native


def alternate(reps: int, run: Callable[[bool, int], float]) -> tuple[float, float]:
    """run(on, rep) -> tok/s for each side `reps` times, on first in even reps and off first in odd
    ones (drift within the process falls on both); the medians (on, off)."""
    got: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps):
        for on in (True, False) if rep % 2 == 0 else (False, True):
            got[on].append(run(on, rep))
    return statistics.median(got[True]), statistics.median(got[False])
