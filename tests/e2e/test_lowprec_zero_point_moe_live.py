"""`milepost train --precision int4` end to end on CPU from a Qwen3-MoE AWQ checkpoint (zero points,
written by hand: milepost/testing/quant_checkpoints.py). The engines start on the checkpoint's
values as stored, MoE experts included (the INT4 expert store with zero points); the trainer loads
their dequantization and fake-quantizes it symmetric, so step 1's gap is the zero points'
difference; every update is re-quantized symmetric by the engines (zero points 0) and passes
`--check-weight-update-equal`, after which both sides hold the same INT4 weights."""

from __future__ import annotations

import json
from pathlib import Path

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.lowprec_runs import two_step_gaps
from milepost.testing.quant_checkpoints import write_awq


def test_rl_run_starts_from_an_awq_moe_checkpoint(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "bf16", "qwen3_moe", seed=5)
    write_awq(tmp_path / "bf16", tmp_path / "awq", 128)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gaps = two_step_gaps(tmp_path / "awq", tmp_path / "prompts.jsonl", tmp_path / "run",
                         "--precision", "int4")
    print(f"AWQ MoE --precision int4 gaps: {gaps}")
    assert gaps[1] < 1e-4 < gaps[0], gaps
