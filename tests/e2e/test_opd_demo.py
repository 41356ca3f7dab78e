"""On-policy distillation on the tiny demo, as a user runs it (recipes/opd_demo.toml).

The student is the demo's lazy-tutor base model (greedy exact rate ~0.1-0.3); the teacher is the
same model trained further on exact drills (milepost/testing/opd_teacher.py). The task reward is
switched off, so the teacher's per-token signal is the whole training signal: after 5 rollouts
the greedy eval reward must have risen by at least 0.3 absolute, with the teacher in the
trainer ranks and with the teacher served by `milepost serve`. About 1.5 minutes each on 2 loaded
cores (2026-12-03).

Bounds from 10 runs of the in-process case (2026-12-03, 2-core VM at load 8-14, torch 2.13, demo
base model of seed 0 with greedy accuracy 0.121: `benchmarks/demo_rl_spread.py --recipe
recipes/opd_demo.toml --num-rollout 5 -- --opd-teacher-checkpoint TEACHER`):
- first rollout's mean reward (bound <= 0.5): mean 0.301, sd 0.033, max 0.367; the one-sided 99%
  prediction bound for a new run, mean + t(0.99, 9) * sd * sqrt(1 + 1/10), is 0.40.
- final greedy eval (bound >= base + 0.3 = 0.42 here): 0.922-0.977, mean 0.959, sd 0.020; the same
  lower prediction bound is 0.90, so the bound sits 27 sd below the mean.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLLOUTS = 5


@pytest.fixture(scope="module")
def teacher_dir(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("opd-teacher") / "teacher"
    subprocess.run([sys.executable, "-m", "milepost.testing.opd_teacher", str(demo_dir / "base_model"),
                    str(out)], check=True, timeout=600)
    return out


def _distil(demo_dir: Path, run_dir: Path, timeout_s: float, *teacher: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", str(ROOT / "recipes" / "opd_demo.toml"),
         "--hf-checkpoint", str(demo_dir / "base_model"), "--prompt-data",
         str(demo_dir / "rl_prompts.jsonl"), "--eval-prompt-data", str(demo_dir / "eval_prompts.jsonl"),
         "--run-dir", str(run_dir), "--num-rollout", str(ROLLOUTS), *teacher],
        timeout=timeout_s, check=False)
    assert done.returncode == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_rise(demo_dir: Path, records: list[dict]) -> None:
    base = json.loads((demo_dir / "base_model" / "demo_model.json").read_text())["greedy_accuracy"]
    assert len(records) == ROLLOUTS
    assert records[0]["rollout/reward_mean"] <= 0.5  # the student starts as the lazy tutor
    kl = [r["opd/reverse_kl_mean"] for r in records]
    assert kl[-1] < kl[0], kl  # the student moves toward the teacher
    final = records[-1]["eval/reward_mean"]
    assert final >= base + 0.3, (base, final)


def test_in_process_teacher_raises_the_demo_reward(
    demo_dir: Path, teacher_dir: Path, demo_train_timeout_s: Callable[[int], float], tmp_path: Path
) -> None:
    records = _distil(demo_dir, tmp_path / "opd", demo_train_timeout_s(ROLLOUTS),
                      "--opd-teacher-checkpoint", str(teacher_dir))
    _check_rise(demo_dir, records)
    assert all(r["opd/teacher_time"] > 0 for r in records)


@pytest.mark.slow
def test_served_teacher_raises_the_demo_reward(
    demo_dir: Path, teacher_dir: Path, demo_train_timeout_s: Callable[[int], float], tmp_path: Path,
    start_server,
) -> None:
    teacher = start_server(teacher_dir, "--max-total-tokens", "32768")
    records = _distil(demo_dir, tmp_path / "opd", demo_train_timeout_s(ROLLOUTS),
                      "--opd-teacher-checkpoint", "none", "--opd-teacher-url", teacher.url)
    _check_rise(demo_dir, records)
    assert all(r["opd/scored_samples/teacher"] == 128 for r in records)
    assert all(r["rollout/teacher_failed_groups"] == 0 for r in records)
