"""The tiny demo, as a user runs it: GRPO must clearly raise the reward on 2 CPU cores.

Builds the demo's base model and prompts (`python -m milepost.demo.prepare`), then runs
`milepost train recipes/tiny_demo.toml` for 20 rollouts and asserts the rise the README shows:
the first rollout's mean reward is at most 0.5 and the last five average at least 0.8. The
recipe's evaluation (greedy, held-out sums, every 5 steps) must score the weights it was given.
About 1.5 minutes on 2 cores (2026-12-02, with other work running).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_grpo_raises_the_demo_reward(
    demo_dir: Path, demo_train_timeout_s: Callable[[int], float], tmp_path: Path
) -> None:
    work, run_dir = demo_dir, tmp_path / "rl"
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", str(ROOT / "recipes" / "tiny_demo.toml"),
         "--hf-checkpoint", str(work / "base_model"), "--prompt-data",
         str(work / "rl_prompts.jsonl"), "--eval-prompt-data", str(work / "eval_prompts.jsonl"),
         "--run-dir", str(run_dir), "--num-rollout", "20", "--save-hf-at-end", "false"],
        timeout=demo_train_timeout_s(20), check=False,
    )
    assert done.returncode == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in records]
    assert len(rewards) == 20
    assert rewards[0] <= 0.5, rewards
    assert sum(rewards[-5:]) / 5 >= 0.8, rewards
    evals = {r["step"]: r for r in records if "eval/reward_mean" in r}
    assert sorted(evals) == [4, 9, 14, 19]
    for step, r in evals.items():
        assert r["eval/weight_version"] == step + 1 and r["eval/num_samples"] == 256
    assert evals[19]["eval/reward_mean"] >= 0.8, {s: r["eval/reward_mean"] for s, r in evals.items()}
