"""`milepost train` end to end on an architecture with no native path (OLMo 2: transformers fallback).

Real launcher, `milepost serve` engine and trainer rank: rollouts, GRPO steps, broadcast weight
updates checked by checksum (the fallback's HF names on both sides), export. The trainer's
recomputed log-probs of the engine's tokens equal the engine's own (fp32), step after step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from milepost.config import TABLE_OF
from milepost.testing.hf_archs import make_tiny_hf_checkpoint

STEPS = 3
REWARDS = "def parity(sample):\n    return float(sum(sample.response_ids) % 2)\n"


def test_milepost_train_on_a_fallback_model(tmp_path: Path) -> None:
    model = make_tiny_hf_checkpoint(tmp_path / "olmo2", "olmo2", seed=3, with_tokenizer=True)
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "fallback_rewards.py").write_text(REWARDS)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = dict(hf_checkpoint=str(model), prompt_data=str(tmp_path / "prompts.jsonl"), num_rollout=STEPS,
                    rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=8,
                    engine_max_total_tokens=2048, lr=1e-3, seed=7, reward_fn="fallback_rewards:parity",
                    check_weight_update=True)
    tables: dict[str, list[str]] = {}
    for key, v in settings.items():
        tables.setdefault(TABLE_OF[key], []).append(f"{key} = {json.dumps(v) if not isinstance(v, bool) else 'true'}")
    recipe = tmp_path / "run.toml"
    recipe.write_text("".join(f"[{t}]\n" + "\n".join(ls) + "\n\n" for t, ls in tables.items()))
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "rewards"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "milepost", "train", str(recipe), "--run-dir", str(run_dir)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == list(range(STEPS))
    for rec in records:
        assert rec["train/train_rollout_logprob_abs_diff"] < 1e-3, rec
    assert (run_dir / "hf" / "model.safetensors").is_file()
