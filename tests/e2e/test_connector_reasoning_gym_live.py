"""A `milepost train` run on reasoning-gym prompts, rewarded by the task's own scorer (issue 25).

The tiny Qwen3 has random weights, so its answers are the engine's doing: each row's metadata
carries a `regex` sampling param that makes every answer `<answer>0</answer>` or `<answer>1</answer>`,
and the two prompts are the task's entries whose answers are 0 and 1. Whatever the model picks,
each step has right and wrong answers: the rewards the run records are the scorer's, not zeros.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.data.rollout_io import load_rollout

pytest.importorskip("reasoning_gym", reason="needs milepost[reasoning-gym]")
rgc = pytest.importorskip("milepost.connectors.reasoning_gym")

STEPS = 2
CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _recipe(path: Path, **settings: object) -> Path:
    from milepost.config import TABLE_OF

    tables: dict[str, list[str]] = {}
    for key, value in settings.items():
        tables.setdefault(TABLE_OF[key], []).append(f"{key} = {json.dumps(value)}")
    path.write_text("".join(f"[{t}]\n" + "\n".join(lines) + "\n\n" for t, lines in tables.items()))
    return path


def test_scorer_rewards_flow_into_training(qwen3_dir: Path, tmp_path: Path) -> None:
    rows = rgc.prompt_rows("basic_arithmetic", size=200, seed=5, config=CONFIG)
    chosen = [next(r for r in rows if r["label"] == digit) for digit in ("0", "1")]
    for row in chosen:
        row["metadata"]["sampling_params"] = {"regex": "<answer>[01]</answer>"}
    prompts = tmp_path / "rg.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    run_dir, saved = tmp_path / "run", tmp_path / "rollouts"
    cmd = [sys.executable, "-m", "milepost", "train",
           str(_recipe(tmp_path / "rg.toml", hf_checkpoint=str(qwen3_dir), prompt_data=str(prompts),
                       num_rollout=STEPS, rollout_batch_size=2, n_samples_per_prompt=4,
                       rollout_max_response_len=16, engine_max_total_tokens=2048, seed=7,
                       reward_fn="milepost.connectors.reasoning_gym:reward")),
           "--run-dir", str(run_dir),
           "--save-rollouts", str(saved), "--device", "cpu"]
    # Generous: ~10 s on 2 idle cores, ~60 s at load 14.
    proc = subprocess.run(cmd, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300 * STEPS)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "train/loss" in m]) == STEPS
    for step in range(STEPS):
        samples = [s for g in load_rollout(saved, step) for s in g]
        assert len(samples) == 8
        for s in samples:  # the run's rewards are the scorer's on what the model answered
            assert s.reward == rgc.reward(s)
            assert s.response in ("<answer>0</answer>", "<answer>1</answer>"), s.response
        assert {s.reward for s in samples} == {0.0, 1.0}
        assert metrics[step]["step"] == step
        assert metrics[step]["rollout/reward_mean"] == pytest.approx(
            sum(s.reward for s in samples) / len(samples))


def test_env_with_an_unknown_task_stops_before_anything_starts(qwen3_dir: Path,
                                                               tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(qwen3_dir),
           "--env", "reasoning_gym:no_such_task", "--num-rollout", "1", "--rollout-batch-size",
           "2", "--device", "cpu", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "--env reasoning_gym:no_such_task" in out and "not registered" in out, out[-4000:]
    assert not list((tmp_path / "run").glob("*.jsonl"))  # no prompts, no metrics
