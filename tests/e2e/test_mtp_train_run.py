"""`milepost train` with NEXTN engines and MTP co-training, end to end on CPU: the engines draft
with the checkpoint's MTP layer (`--sglang-speculative-algorithm NEXTN`), the trainer trains it
(`--enable-mtp-training`), the equality check passes at the first update with the MTP layer in
it, and the run reports the MTP loss and the engines' acceptance (SGLang's spec_* meta_info)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint

TIMEOUT_S = 300  # ~10 s on 2 idle cores


def test_nextn_engines_and_mtp_cotraining_in_a_run(tmp_path: Path) -> None:
    ckpt = make_tiny_mtp_checkpoint(tmp_path / "m", seed=5, with_tokenizer=True)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(ckpt),
           "--prompt-data", str(tmp_path / "prompts.jsonl"), "--run-dir", str(run_dir),
           "--device", "cpu", "--num-rollout", "2", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
           "--engine-max-total-tokens", "1024", "--reward-fn", "exact_match", "--lr", "1e-3",
           "--check-weight-update-equal", "--sglang-speculative-algorithm", "NEXTN",
           "--sglang-speculative-num-steps", "2", "--enable-mtp-training"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for s in steps:
        assert s["train/mtp_loss"] > 0
        assert 1.0 <= s["rollout/spec_accept_length"] <= 3.0  # 2 proposals per verify at most
        assert 0.0 <= s["rollout/spec_accept_rate"] <= 1.0
