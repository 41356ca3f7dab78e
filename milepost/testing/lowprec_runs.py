"""A two-step `milepost train` on a tiny checkpoint with the weight-update equality check, and
the train/rollout log-prob gap of each step: the low-precision e2e tests' run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 300  # a two-step tiny run takes ~15 s on 2 idle cores


def two_step_gaps(checkpoint: Path, prompts: Path, run_dir: Path, *flags: str) -> list[float]:
    """Runs the training (asserting it ends well) and returns the gap of both steps."""
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(checkpoint),
           "--prompt-data", str(prompts), "--run-dir", str(run_dir),
           "--device", "cpu", "--num-rollout", "2", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
           "--engine-max-total-tokens", "1024", "--reward-fn", "exact_match",
           "--check-weight-update-equal", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [s["train/train_rollout_logprob_abs_diff"] for s in steps
            if "train/train_rollout_logprob_abs_diff" in s]
    assert len(gaps) == 2 and all(math.isfinite(g) for g in gaps), gaps
    return gaps
