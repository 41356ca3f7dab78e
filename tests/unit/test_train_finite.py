"""Non-finite training: a step with a NaN gradient norm is skipped (metric + message, weights
unchanged); weights that are NaN after a step stop the run on every rank before any update."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.finite import (
    TrainingDivergedError,
    check_after_steps,
    count_non_finite,
)
from milepost.train.fsdp import FSDPBackend, TrainerSettings


def test_check_after_steps_counts_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    good, bad = torch.ones(3), torch.tensor([1.0, float("inf")])
    assert float(count_non_finite([good, torch.arange(3), bad, bad * 0])) == 2  # inf*0 is NaN
    with caplog.at_level(logging.WARNING, "milepost.train.finite"):
        check_after_steps([good], 1, 1e-3, lambda v: v)
    assert "skipped 1 optimizer step" in caplog.text
    with pytest.raises(TrainingDivergedError, match="1 weight tensor.*lr 1e\\+30.*Lower --lr"):
        check_after_steps([good, bad], 0, 1e30, lambda v: v)


def _poisoned_worker(rank: int, world: int, path: str) -> dict:
    backend = FSDPBackend.create(path, TrainerSettings(lr=1e-3, global_batch_size=2))
    batch = random_train_batch(2, 0)
    before = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in backend.policy.lm.named_parameters()}
    # A NaN reward-side advantage gives NaN gradients: the step must be skipped, not taken.
    batch.advantages[0][:] = float("nan")
    metrics = backend.train_step(batch)
    after = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for n, p in backend.policy.lm.named_parameters()}
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    # Weights made NaN (as a diverged step would leave them): the next step stops the run.
    with torch.no_grad():
        p = next(backend.policy.lm.parameters())
        (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))
    try:
        backend.train_step(random_train_batch(2, 1))
        raised = ""
    except TrainingDivergedError as e:
        raised = str(e)
    return {"skipped": metrics["skipped_steps"], "unchanged": unchanged, "raised": raised}


def test_nan_step_is_skipped_and_nan_weights_stop_the_run(tmp_path: Path) -> None:
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False))
    [out] = run_ranks(_poisoned_worker, 1, path)
    assert out["skipped"] == 1 and out["unchanged"]
    assert "training diverged" in out["raised"] and "nothing was sent" in out["raised"]
