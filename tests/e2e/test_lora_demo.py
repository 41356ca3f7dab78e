"""The tiny demo with LoRA only: GRPO on a rank-8 adapter must raise the reward (issue 21).

Runs `milepost train recipes/tiny_demo_lora.toml` on the session's demo base model and prompts
(`demo_dir`), cheaper than the recipe: 20 rollouts of 16 prompts x 8 samples (one optimizer step
of 128 samples each), no evaluation, with `--check-weight-update-equal` (the engines' adapter is
randomized before the first update, which must then write every adapter tensor). Asserts the
demo's rise, that each update moved only the adapter, that the run ends with a PEFT adapter,
and that resuming its checkpoint with another --lora-rank is refused at start.

Bounds from 7 runs of this training (2026-12-03, 2-core VM shared with other jobs, load 8-17,
torch 2.13, demo base model of seed 0; two of the runs also evaluated once at the end):
- first rollout's mean reward (bound <= 0.5): 0.312 0.312 0.344 0.234 0.250 0.297 0.266
  (mean 0.288, std 0.039); the one-sided 99% prediction bound for a new run,
  mean + t(0.99, 6) * std * sqrt(1 + 1/7), is 0.42.
- mean of the last five (bound >= 0.85): 0.966 0.959 0.941 0.940 0.960 0.965 0.944
  (mean 0.954, std 0.011); the same prediction bound is 0.915, and the issue asks >= 0.8: 0.85
  sits between them, 9 std below the mean.
Four more runs (2026-12-03, load 8-14, `benchmarks/demo_rl_spread.py --recipe recipes/tiny_demo_lora.toml`
with this test's flags): first 0.281 0.328 0.281 0.297, last five 0.941 0.972 0.975 0.916. Over all
11 runs: first mean 0.291, sd 0.033, 99% upper prediction bound 0.39 (bound 0.5); last five mean
0.953, sd 0.018, lower prediction bound 0.90 (bound 0.85).
One run took 39-164 s at that load (the recipe's 256 samples per rollout take ~4x longer).
Those 11 runs used 8 prompts x 8 samples per rollout and session 8's build of the seed-0 base (925
drill + 150 tutor steps). Session 10's build (2026-12-04, torch 2.13, transformers 5.25: 1175 + 125
steps, as on the H200 machine) learned less at that size: last five 0.834 0.897 0.872 0.875 0.903
0.903 0.838 0.916 (8 runs, two below 0.85), the recipe itself 0.960 (1 run). So the test now takes
16 prompts x 8 samples (128 per step; 22-40 s a run at load 5): 8 runs, first 0.305 0.305 0.320
0.266 0.297 0.297 0.305 0.250 (mean 0.293, sd 0.023, upper 99% prediction bound 0.37), last five
0.933 0.939 0.927 0.939 0.948 0.958 0.956 0.936 (mean 0.942, sd 0.011, lower bound 0.907); the
bounds 0.5 and 0.85 stay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
LAST_FIVE_BOUND = 0.85


def test_lora_only_grpo_raises_the_demo_reward(
    demo_dir: Path, demo_train_timeout_s: Callable[[int], float], tmp_path: Path
) -> None:
    work, run_dir = demo_dir, tmp_path / "rl-lora"
    command = [sys.executable, "-m", "milepost", "train", str(ROOT / "recipes" / "tiny_demo_lora.toml"),
               "--hf-checkpoint", str(work / "base_model"), "--prompt-data", str(work / "rl_prompts.jsonl"),
               "--eval-prompt-data", "none", "--eval-interval", "0", "--run-dir", str(run_dir),
               "--num-rollout", "20", "--rollout-batch-size", "16", "--global-batch-size", "128",
               "--check-weight-update-equal"]
    done = subprocess.run(command, timeout=demo_train_timeout_s(20), check=False)
    assert done.returncode == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in records]
    assert len(rewards) == 20
    assert rewards[0] <= 0.5, rewards
    assert sum(rewards[-5:]) / 5 >= LAST_FIVE_BOUND, rewards  # bounds: see the docstring
    adapter = load_file(str(run_dir / "hf" / "adapter_model.safetensors"))  # --save-hf-at-end: PEFT
    adapter_bytes = sum(t.numel() * 4 for t in adapter.values())  # fp32, as the run sends them
    assert len(adapter) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    base_bytes = (work / "base_model" / "model.safetensors").stat().st_size
    for r in records:  # every update moved the adapter and nothing else
        assert r["perf/update_weights_bytes"] == adapter_bytes < base_bytes / 10
    # The checkpoint records the adapter's layout: resuming it with another rank is refused at start.
    other = subprocess.run([*command, "--num-rollout", "21", "--lora-rank", "4"], timeout=120, check=False,
                           capture_output=True, text=True)
    assert other.returncode != 0
    assert "was trained with --lora-rank 8" in other.stderr + other.stdout, other.stderr[-3000:]
    assert "but this run has --lora-rank 4" in other.stderr + other.stdout, other.stderr[-3000:]
