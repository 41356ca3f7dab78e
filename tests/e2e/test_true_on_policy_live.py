"""The tiny demo with --true-on-policy reports train_rollout_logprob_abs_diff exactly 0.0 on every
step; without it the same run reports a non-zero gap, which `milepost diagnose mismatch`
re-creates from the saved rollout and breaks down by source.

Both runs are short (3 and 2 rollouts of 4 prompts x 8 samples, fp32 as the recipe, no
evaluation) on the session's demo base model (`demo_dir`). Measured (2026-12-03, 2 busy CPU
cores): without the flag the gap was 3.8e-07 and 1.0e-07 per token; the diagnosis put 87% of
step 0's on engine decode vs prefill kernels. In bf16 the tiny demo showed no gap even without
the flag (its bf16 roundings absorb the fp32-level differences), so fp32 is the discriminating case.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _train(work: Path, run_dir: Path, rollouts: int, timeout: float, *flags: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", str(ROOT / "recipes" / "tiny_demo.toml"),
         "--hf-checkpoint", str(work / "base_model"), "--prompt-data", str(work / "rl_prompts.jsonl"),
         "--eval-prompt-data", "none", "--eval-interval", "0", "--run-dir", str(run_dir),
         "--num-rollout", str(rollouts), "--rollout-batch-size", "4", "--global-batch-size", "32", *flags],
        timeout=timeout, check=False,
    )
    assert done.returncode == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_true_on_policy_demo_gap_is_zero_and_default_gap_is_explained(
    demo_dir: Path, demo_train_timeout_s: Callable[[int], float], tmp_path: Path
) -> None:
    on = _train(demo_dir, tmp_path / "on", 3, demo_train_timeout_s(3), "--true-on-policy")
    assert [r["train/train_rollout_logprob_abs_diff"] for r in on] == [0.0, 0.0, 0.0]

    off_dir = tmp_path / "off"
    off = _train(demo_dir, off_dir, 2, demo_train_timeout_s(2), "--save-rollouts", str(off_dir / "rollouts"))
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in off]
    assert len(gaps) == 2 and gaps[0] > 0.0, gaps  # the control: the flag is what makes it 0

    table = subprocess.run([sys.executable, "-m", "milepost", "diagnose", "mismatch", str(off_dir)],
                           capture_output=True, text=True, timeout=300, check=True).stdout
    total = float(re.search(r"\|saved - trainer\| = (\S+) per token", table).group(1))
    # The diagnosis re-creates step 0's gap from the saved batch (same weights, same packing).
    assert abs(total - gaps[0]) <= 0.25 * gaps[0], (total, gaps[0], table)
    links = dict(re.findall(r"^(\w+ -> \w+)\s+(\S+)", table, flags=re.MULTILINE))
    assert set(links) == {"saved -> decode", "decode -> prefill", "prefill -> trainer",
                          "trainer -> alone", "trainer -> fp32"}, table
    chain = sum(float(links[k]) for k in ("saved -> decode", "decode -> prefill", "prefill -> trainer"))
    assert chain >= total * (1 - 1e-6), table  # the chain bounds the total (triangle inequality)
    assert float(links["trainer -> fp32"]) == 0.0, table  # an fp32 run: precision explains nothing
