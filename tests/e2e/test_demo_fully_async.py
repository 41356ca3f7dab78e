"""The tiny demo still learns under fully asynchronous RL (issue 5, "must reach").

Builds the demo's base model and prompts (`python -m milepost.demo.prepare`), then runs
`milepost train recipes/tiny_demo.toml --fully-async` (engine generating while the trainer
trains; old log-probs from the engine, the fully-async default) for 20 rollouts and asserts the
reward rises as in the synchronous demo: the first rollout's mean reward at most 0.5, the last
five at least 0.6 on average and 0.25 above the first, with groups actually trained off-policy (staleness >= 1), the
held-out greedy evaluation at the end at least 0.8, and every drawn prompt accounted for.
Measured 2026-12-02 (loaded 2-core VM): rewards 0.29 -> 0.86 at rollout 8, last five 0.89,
max staleness 7, evaluation 0.99 / 0.97; over seven runs that day the last five averaged
0.67-0.89 (max staleness 7-10) and the final evaluation was 0.95-0.98. The whole test: 79 s on an idle machine, 5.7 minutes
at load average 5 (the demo's `prepare` is most of it).
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
def test_fully_async_grpo_raises_the_demo_reward(
    demo_dir: Path, demo_train_timeout_s: Callable[[int], float], tmp_path: Path
) -> None:
    work, run_dir = demo_dir, tmp_path / "rl-async"
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", str(ROOT / "recipes" / "tiny_demo.toml"),
         "--hf-checkpoint", str(work / "base_model"), "--prompt-data",
         str(work / "rl_prompts.jsonl"), "--eval-prompt-data", str(work / "eval_prompts.jsonl"),
         "--eval-interval", "10", "--run-dir", str(run_dir), "--num-rollout", "20",
         "--save-hf-at-end", "false", "--fully-async"],
        check=False, timeout=demo_train_timeout_s(20),
    )
    assert done.returncode == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in records]
    assert len(rewards) == 20
    assert rewards[0] <= 0.5, rewards
    # Sampled rewards lag the greedy score under staleness 7-10: the last five averaged
    # 0.67-0.89 over seven runs; the held-out greedy evaluation below is the sharper check.
    assert sum(rewards[-5:]) / 5 >= max(0.6, rewards[0] + 0.25), rewards
    assert max(r["rollout/fully_async/max_staleness"] for r in records) >= 1
    # Evaluation on the shared engines (new groups hold while it runs) scores its step's weights.
    evals = {r["step"]: r for r in records if "eval/reward_mean" in r}
    assert sorted(evals) == [9, 19]
    for step, r in evals.items():
        assert r["eval/weight_version"] == step + 1 and r["eval/mixed_version_frac"] == 0, r
    assert evals[19]["eval/reward_mean"] >= 0.8, evals
    a = json.loads((run_dir / "fully_async_accounting.json").read_text())
    dropped = sum(v for k, v in a.items() if k.startswith("prompts_dropped_"))
    assert a["prompts_drawn"] == a["prompts_trained"] + dropped + a["in_buffer"] + a["generating"]
    assert a["prompts_trained"] == 20 * 32
