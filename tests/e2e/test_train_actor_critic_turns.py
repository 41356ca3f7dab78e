"""`milepost train` with PPO and --offload-actor-for-critic (issue 9, report 3.2), on CPU from saved
rollouts (no engines): the actor and the critic take turns on the device within every step, the
turns are timed as perf/actor_critic_swap_time, and the weights come out bitwise the same as a run
where both stay resident."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from milepost.data.rollout_io import save_rollout
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.types import Sample

STEPS = 2


def write_rollouts(directory: Path) -> None:
    g = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        groups = []
        for gi in range(2):
            group = []
            for i in range(2):
                prompt = torch.randint(3, 500, (5,), generator=g).tolist()
                response = torch.randint(3, 500, (4 + i,), generator=g).tolist()
                group.append(Sample(gi, i, tokens=prompt + response, response_length=len(response),
                                    reward=float(torch.rand((), generator=g) > 0.5)))
            groups.append(group)
        save_rollout(directory, step, groups)


def train(tmp: Path, name: str, *flags: str) -> Path:
    run_dir = tmp / name
    cmd = [sys.executable, "-m", "milepost", "train", "--run-dir", str(run_dir),
           "--hf-checkpoint", str(tmp / "m"), "--prompt-data", str(tmp / "prompts.jsonl"),
           "--load-rollouts", str(tmp / "rollouts"), "--num-rollout", str(STEPS),
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--device", "cpu",
           "--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--lr", "1e-3", "--seed", "3",
           "--save-interval", "0", "--save-hf-at-end", "true", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ppo_turns_through_milepost_train_are_timed_and_change_nothing(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    write_rollouts(tmp_path / "rollouts")
    resident = train(tmp_path, "resident", "--offload-actor-for-critic", "false")
    turns = train(tmp_path, "turns", "--offload-actor-for-critic", "true", "--offload-train", "true",
                  "--offload-train-destination", "disk")
    plain, moved = metrics(resident), metrics(turns)
    assert all("perf/actor_critic_swap_time" not in r for r in plain)
    assert all(r["perf/actor_critic_swap_time"] > 0 for r in moved)
    for a, b in zip(plain, moved):
        assert a["train/value_loss"] == b["train/value_loss"] and a["train/loss"] == b["train/loss"]
    a, b = load_file(resident / "hf" / "model.safetensors"), load_file(turns / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
