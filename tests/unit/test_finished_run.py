"""`finished_checkpoint`: a rerun of a run whose last step is checkpointed starts nothing
(milepost/driver/preflight.py); anything short of that resumes as before."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from milepost.driver.preflight import finished_checkpoint
from milepost.train.checkpoint import META_FILE, checkpoint_path


def _cfg(run_dir: Path, num_rollout: int, **over: object) -> SimpleNamespace:
    return SimpleNamespace(**{"run_dir": run_dir, "num_rollout": num_rollout, "resume": "auto",
                              "rollout_only": False, **over})


def _checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    path = checkpoint_path(run_dir, step)
    path.mkdir(parents=True)
    if complete:
        (path / META_FILE).write_text(json.dumps({"extra": {"step": step}}))
    return path


def test_the_last_step_checkpointed_means_nothing_to_train(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    last = _checkpoint(tmp_path, 3)
    assert finished_checkpoint(_cfg(tmp_path, 4)) == last
    assert finished_checkpoint(_cfg(tmp_path, 3)) == last  # fewer rollouts asked: done too


def test_steps_left_half_written_or_no_checkpoint_resume_as_before(tmp_path: Path) -> None:
    assert finished_checkpoint(_cfg(tmp_path, 4)) is None  # a fresh run
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 3, complete=False)  # killed while writing the last one
    assert finished_checkpoint(_cfg(tmp_path, 4)) is None
    assert finished_checkpoint(_cfg(tmp_path, 5)) is None
    assert finished_checkpoint(_cfg(tmp_path, 3)) is not None


def test_never_resume_and_rollout_only_runs_always_start(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 3)
    assert finished_checkpoint(_cfg(tmp_path, 4, resume="never")) is None
    assert finished_checkpoint(_cfg(tmp_path, 4, rollout_only=True)) is None
