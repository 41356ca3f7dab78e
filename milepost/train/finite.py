"""What the trainer does when numbers stop being finite.

A step whose gradient norm is NaN/inf is skipped (milepost/train/optim.py, metric
`skipped_steps`); this module covers the rest: weights that an optimizer step made NaN or
infinite cannot be undone cheaply, so the run stops there with a message naming the cause,
before any weight update could send them to the engines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """The trainer's weights hold NaN or infinity; nothing was sent to the engines."""


def count_non_finite(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """How many of `params` (this rank's shards) hold a NaN or an infinity: a device scalar, so
    the caller can fold it into a collective it already makes (no extra host sync here)."""
    flags = []
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.is_floating_point() and local.numel():
            flags.append(~torch.isfinite(local.detach()).all())
    if not flags:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(flags).sum().double()


def check_after_steps(params: Iterable[torch.Tensor], skipped: int, lr: float,
                      all_reduce: Callable[[list[float]], list[float]]) -> None:
    """After a train step's optimizer steps: say so if some were skipped (non-finite gradient
    norm), and raise TrainingDivergedError on every rank if any rank's weights are not finite.

    `all_reduce` sums a list of floats over the trainer ranks (a collective: every rank calls
    this, in step).
    """
    bad = int(all_reduce([float(count_non_finite(params))])[0])
    if bad:
        raise TrainingDivergedError(
            f"training diverged: {bad} weight tensor(s) hold NaN or infinite values after an "
            f"optimizer step (lr {lr:g}); nothing was sent to the engines. Lower --lr, set "
            "--clip-grad, or resume from the last checkpoint")
    if skipped:
        log.warning("skipped %d optimizer step(s) whose gradient norm was NaN or infinite "
                    "(metric skipped_steps); the weights were left as they were", skipped)
