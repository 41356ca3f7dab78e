"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine to min_lr).

The schedule is a pure function of the optimizer step (`lr_at`), wrapped in a `LambdaLR` whose
state (the step counter) is what checkpoints save; the function itself is rebuilt from settings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR

from milepost.train.optim_stream import StreamingAdamW
from milepost.train.settings import DTYPES, TrainerSettings


def lr_at(step: int, s: TrainerSettings) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    if s.lr_warmup_iters and step < s.lr_warmup_iters:
        return s.lr * (step + 1) / s.lr_warmup_iters
    if s.lr_decay_style == "constant":
        return s.lr
    span = s.num_steps_total - s.lr_warmup_iters
    progress = min(max(step - s.lr_warmup_iters, 0) / span, 1.0)
    return s.min_lr + (s.lr - s.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], s: TrainerSettings, stream_dir: Path | None = None
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over `params` and its schedule (the lr before the first step is lr_at(0)).

    With `stream_dir`, the Adam moments stream from files there (StreamingAdamW; same update).
    """
    hyper = dict(lr=s.lr, betas=(s.adam_beta1, s.adam_beta2), eps=s.adam_eps,
                 weight_decay=s.weight_decay)
    if stream_dir is not None:
        optimizer: torch.optim.Optimizer = StreamingAdamW(
            params, stream_dir, bucket_bytes=s.optimizer_bucket_bytes,
            moment_dtype=DTYPES[s.optimizer_moment_dtype], **hyper)
    else:
        # Fused AdamW on CUDA: one kernel for the whole update instead of a foreach chain; CPU keeps
        # the default implementation (the reference the exactness tests compare against).
        optimizer = torch.optim.AdamW(list(params), fused=s.device == "cuda", **hyper)
    base = s.lr if s.lr > 0 else 1.0  # LambdaLR multiplies the base lr; avoid 0 * factor losing the schedule
    for group in optimizer.param_groups:
        group["lr"] = base * group.get("lr_scale", 1.0)  # multi-LoRA: each adapter's lr / the run's
    scheduler = LambdaLR(optimizer, lambda step: lr_at(step, s) / base)
    return optimizer, scheduler


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, grad_norm: float) -> int:
    """Step (unless the gradient norm is nan/inf: it would poison the weights and Adam's moments),
    advance the schedule, zero the gradients; returns 1 when the update was skipped."""
    skipped = 0 if math.isfinite(grad_norm) else 1
    if not skipped:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return skipped
