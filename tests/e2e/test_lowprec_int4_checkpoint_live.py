"""`milepost train --precision int4 --hf-checkpoint INT4_DIR` end to end on CPU: an RL run from a
compressed-tensors W4A16 checkpoint (written by hand, milepost/testing/quant_checkpoints.py). The
trainer loads it dequantized and fake-quantizes in INT4; the engines start on the checkpoint's
own packed values (the INT4 store, as stored) and re-quantize every update, checked by
`--check-weight-update-equal`."""

from __future__ import annotations

import json
from pathlib import Path

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.lowprec_runs import two_step_gaps
from milepost.testing.quant_checkpoints import write_awq, write_int4


def test_rl_run_starts_from_an_int4_checkpoint(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=5)
    # A 7 in every group: the trainer's INT4 quantizer (scale = amax / 7) gives these values and
    # scales back, so step 1's rollout (the checkpoint's bytes) and the trainer's forward agree.
    write_int4(tmp_path / "bf16", tmp_path / "int4", 128, amax_seven=True)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    gaps = two_step_gaps(tmp_path / "int4", tmp_path / "prompts.jsonl", run_dir, "--precision", "int4")
    assert gaps[0] < 1e-4, gaps
    assert "quantization_config" not in json.loads((run_dir / "hf" / "config.json").read_text())


def test_rl_run_starts_from_an_awq_checkpoint(tmp_path: Path) -> None:
    """AWQ (zero points): the engines start on the checkpoint's values as stored (the INT4 store
    with zero points), the trainer on their dequantization fake-quantized symmetric, so step 1's
    gap is the zero points' difference; every update is re-quantized symmetric by the engines and
    passes `--check-weight-update-equal`, after which both sides hold the same INT4 weights."""
    make_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=5)
    write_awq(tmp_path / "bf16", tmp_path / "awq", 128)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gaps = two_step_gaps(tmp_path / "awq", tmp_path / "prompts.jsonl", tmp_path / "run",
                         "--precision", "int4")
    assert gaps[1] < 1e-4 < gaps[0], gaps
