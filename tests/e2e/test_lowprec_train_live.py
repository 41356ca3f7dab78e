"""`milepost train --precision ...` end to end on CPU: the trainer's quantized linears, engines
started in the matching format, every update re-quantized and checked within the format's
bound (`--check-weight-update-equal`), the train/rollout log-prob gap reported each step; under
delayed FP8 scaling the engines follow the trainer's input scales, so the gap closes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.testing.checkpoints import make_tiny_checkpoint

TIMEOUT_S = 300  # a two-step tiny run takes ~15 s on 2 idle cores


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lowprec_run")
    make_tiny_checkpoint(root / "qwen3", "qwen3", seed=5)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize("flags", [["--precision", "bf16-train-fp8-serve"],
                                   ["--precision", "nvfp4", "--nvfp4-four-over-six",
                                    "--precision-override", "layers.1-1=bf16"],
                                   ["--precision", "fp8", "--fp8-scaling", "delayed"]],
                         ids=["bf16-train-fp8-serve", "nvfp4", "fp8-delayed"])
def test_quantized_run_trains_and_reports_the_gap(work: Path, flags: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(work / "qwen3"),
           "--prompt-data", str(work / "prompts.jsonl"), "--run-dir", str(run_dir),
           "--device", "cpu", "--num-rollout", "2", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
           "--engine-max-total-tokens", "1024", "--reward-fn", "exact_match",
           "--check-weight-update-equal", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [s["train/train_rollout_logprob_abs_diff"] for s in steps
            if "train/train_rollout_logprob_abs_diff" in s]
    assert len(gaps) == 2 and all(math.isfinite(g) for g in gaps), gaps
    resolved = (run_dir / "config.resolved.toml").read_text()
    if flags[1] == "bf16-train-fp8-serve":
        assert 'ratio_correction = "tis"' in resolved  # on by default for this arrangement
        assert all(g > 0 for g in gaps)  # fp32 trainer, FP8 engines: a gap, corrected by TIS
    if "delayed" in flags:  # the engines quantize with the trainer's input scales (static)
        assert 'ratio_correction = "none"' in resolved
        assert gaps[1] < 1e-5, gaps  # measured 0 to 4e-9 from step 2 (0.09 without the scales)
