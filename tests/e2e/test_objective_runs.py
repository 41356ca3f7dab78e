"""`milepost train` with the objective's options end to end (engines, trainer, weight updates):
R3 + TIS on a tiny Qwen3-MoE (the engine's routed experts reach the trainer through the rollout),
and REINFORCE++-baseline with clip-or-pop and a KL reward penalty on a dense model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from milepost.testing.checkpoints import make_tiny_checkpoint

BASE = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "6", "--engine-max-total-tokens", "2048", "--lr", "1e-3",
        "--reward-fn", "milepost.testing.rewards:token_parity_reward", "--device", "cpu", "--seed", "3"]


def _run(tmp_path: Path, arch: str, *flags: str) -> list[dict]:
    model = make_tiny_checkpoint(tmp_path / arch, arch, seed=4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                               for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]))
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(model), "--prompt-data",
           str(prompts), "--run-dir", str(run), *BASE, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_r3_and_tis_in_a_moe_training_run(tmp_path: Path) -> None:
    metrics = _run(tmp_path, "qwen3_moe", "--use-rollout-routing-replay", "--ratio-correction", "tis")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        # same weights on both sides (fp32, CPU): replayed routing and the trainer's agree
        assert m["train/r3_routing_mismatch_frac"] < 0.05
        assert abs(m["train/rollout_ratio"] - 1.0) < 1e-3 and m["train/rollout_ratio_clipfrac"] == 0.0
        assert m["train/rollout_ratio_abs_dev"] < 1e-3


def test_reinforce_pp_baseline_with_clip_or_pop_and_kl_reward(tmp_path: Path) -> None:
    metrics = _run(tmp_path, "qwen3", "--advantage-estimator", "reinforce_plus_plus_baseline",
                   "--ratio-correction", "clip_or_pop", "--tis-clip-low", "0.5", "--kl-coef", "0.1",
                   "--kl-loss-type", "low_var_kl", "--loss-aggregation", "sequence_mean")
    assert [m["step"] for m in metrics] == [0, 1]
    assert all("train/rollout_ratio_clipfrac" in m and "train/sft_loss" not in m for m in metrics)
    assert metrics[1]["train/kl"] >= 0.0  # low_var_kl of the policy vs the initial reference
