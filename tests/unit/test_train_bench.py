"""`milepost bench train` on CPU: both sides run on the same batch, the report adds up, bad flags refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.bench.train_setup import shape_config, train_flops
from milepost.cli import main


def test_bench_train_reports_both_sides_and_the_ratio(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "train", "--shape", "tiny", "--samples", "4", "--prompt", "12", "--response", "8",
                 "--steps", "2", "--micro-batch-tokens", "40", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    for side in ("milepost", "hf"):
        r = report[side]
        assert len(r["step_times"]) == 2 and r["tokens_per_s"] == pytest.approx(4 * 20 / r["step_s"])
    assert report["ratio"] == pytest.approx(report["milepost"]["tokens_per_s"] / report["hf"]["tokens_per_s"])
    assert report["hf"]["micro_batch"] == 2  # two 20-token samples fit in 40 tokens
    assert "ratio" in capsys.readouterr().out


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_bench_train_times_a_quantized_trainer_beside_bf16(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           scaling: str) -> None:
    out = tmp_path / "r.json"
    assert main(["bench", "train", "--shape", "tiny", "--samples", "2", "--prompt", "8", "--response", "8",
                 "--steps", "1", "--precision", "fp8_block", "--fp8-scaling", scaling, "--no-hf",
                 "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "hf" not in report and report["precision"] == "fp8_block" and report["fp8_scaling"] == scaling
    # delayed: the warm-up and the timed step each entered the amax history; bf16 has none
    assert report["milepost"].get("fp8_history_steps") == (2 if scaling == "delayed" else None)
    assert "fp8_history_steps" not in report["milepost_bf16"]
    assert report["precision_ratio"] == pytest.approx(
        report["milepost"]["tokens_per_s"] / report["milepost_bf16"]["tokens_per_s"])
    assert "the bf16 trainer's tokens/s" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--shape", "tiny", "--samples", "0"], "--samples must be >= 1"),
    (["--model", "/nonexistent"], "has no config.json"),
    (["--shape", "tiny", "--prompt", "4000", "--response", "200"], "max_position_embeddings (4096)"),
    (["--shape", "tiny", "--fp8-scaling", "delayed"], "--fp8-scaling delayed needs --precision fp8_block"),
    (["--shape", "tiny", "--precision", "fp8_block", "--fp8-scaling", "delayed", "--backend", "both"],
     "FSDP backend only"),
])
def test_bench_train_refuses_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    try:
        code = main(["bench", "train", *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and message in capsys.readouterr().err


def test_train_flops_count_dense_moe_and_attention() -> None:
    dense = shape_config("qwen3-0.6b", None)
    # 28 layers x (attention 1024*2048*2 + 2*1024*1024 + MLP 3*1024*3072) weights, 6 FLOPs each per token
    per_layer = 1024 * 2048 * 2 + 2 * 1024 * 1024 + 3 * 1024 * 3072
    expected = 6 * 28 * per_layer * 2 * 10 + 6 * 1024 * 151936 * 2 * 4 + 6 * 28 * 2 * 100 * 16 * 128
    assert train_flops(dense, 2, 6, 4) == pytest.approx(expected)
    moe = shape_config("qwen3-30b-a3b", 2)
    # a token uses 8 of 128 experts: far fewer FLOPs than all experts
    assert train_flops(moe, 1, 1, 1) < 6 * 2 * (2 * 2048 * 128 * 3 * 768) * 2 / 4
