"""--precision settings: the contract reaches the trainer and the engine command, TIS comes on
for a bf16 trainer beside quantized engines, and the report's refusals fire at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.driver.trainer_settings import trainer_settings
from milepost.launch.local import LocalLauncher
from milepost.testing.run_args import stub_run_args


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    return stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4",
                         "--n-samples-per-prompt", "2", "--device", "cpu")


def test_bf16_train_fp8_serve_reaches_both_sides_with_tis(base: list[str]) -> None:
    cfg = load_config(None, [*base, "--precision", "bf16-train-fp8-serve",
                             "--precision-override", "layers.0-1=bf16"])
    assert cfg.ratio_correction == "tis"  # on by default for this arrangement
    assert trainer_settings(cfg).precision == "bf16"
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(12345)
    i = cmd.index("--quantization")
    assert cmd[i:i + 4] == ["--quantization", "fp8_block", "--precision-override", "layers.0-1=bf16"]
    explicit = load_config(None, [*base, "--precision", "bf16-train-fp8-serve",
                                  "--ratio-correction", "none"])
    assert explicit.ratio_correction == "none"  # an explicit choice is kept
    plain = load_config(None, base)
    assert plain.ratio_correction == "none" and "--quantization" not in \
        LocalLauncher(plain, plain.run_dir)._engine_cmd(12345)


def test_int4_qat_reaches_both_sides(base: list[str]) -> None:
    cfg = load_config(None, [*base, "--precision", "int4"])
    assert trainer_settings(cfg).precision == "int4"
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(12345)
    assert cmd[cmd.index("--quantization") + 1] == "int4"


def test_nvfp4_contract_reaches_both_sides(base: list[str]) -> None:
    cfg = load_config(None, [*base, "--precision", "nvfp4", "--nvfp4-four-over-six",
                             "--nvfp4-dequantized-backward"])
    s = trainer_settings(cfg)
    assert (s.precision, s.nvfp4_four_over_six, s.nvfp4_dequantized_backward) == ("nvfp4", True, True)
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(12345)
    assert "--nvfp4-four-over-six" in cmd and cmd[cmd.index("--quantization") + 1] == "nvfp4"
    assert cfg.ratio_correction == "none"  # same format on both sides: no default correction


def test_w8a8_experts_reach_the_fp8_engines(base: list[str]) -> None:
    cfg = load_config(None, [*base, "--precision", "bf16-train-fp8-serve", "--fp8-w8a8-experts"])
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(12345)
    assert "--fp8-w8a8-experts" in cmd and cmd[cmd.index("--quantization") + 1] == "fp8_block"
    w8a16 = load_config(None, [*base, "--precision", "bf16-train-fp8-serve"])
    assert "--fp8-w8a8-experts" not in LocalLauncher(w8a16, w8a16.run_dir)._engine_cmd(12345)


@pytest.mark.parametrize(("flags", "message"), [
    (["--fp8-w8a8-experts"], "the engines serve bf16"),
    (["--precision", "int4", "--fp8-w8a8-experts"], "the engines serve int4"),
    (["--rollout-precision", "nvfp4"], "nvfp4 with a bf16 trainer"),
    (["--precision", "fp8", "--rollout-precision", "mxfp8"], "the two sides run the same format"),
    (["--precision", "fp8", "--precision-override", "lm_head*=nvfp4"], "keeps tensors in bf16"),
    (["--precision", "fp8", "--precision-override", "layers.0-1"], "PATTERN=FORMAT"),
    (["--precision", "fp8", "--nvfp4-four-over-six"], "refines the NVFP4 recipe"),
    (["--precision", "fp8", "--engine-quantization", "fp8"], "drop --engine-quantization"),
    (["--precision", "bf16-train-fp8-serve", "--engine-backend", "sglang"], "--engine-backend embedded"),
    (["--precision", "fp8", "--lora-rank", "8"], "LoRA does not stack on these quantized linears yet"),
    (["--precision", "mxfp8", "--true-on-policy"], "cannot give bitwise-equal"),
])
def test_refused_at_start(base: list[str], flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, *flags])


def test_shapes_the_format_cannot_hold_are_refused_before_anything_starts(tmp_path: Path) -> None:
    args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4",
                         "--device", "cpu", "--precision", "nvfp4")
    (tmp_path / "model" / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}))
    with pytest.raises(ConfigError, match=r"model.layers.N.mlp.down_proj.weight has 40 input "
                                          r"features, not a multiple of nvfp4's block of 16"):
        load_config(None, args)
    load_config(None, [*args, "--precision-override", "*.down_proj.weight=bf16"])  # kept in bf16
    load_config(None, [*args[:-2], "--precision", "fp8"])  # fp8 tiles take partial blocks


def test_moe_experts_under_precision_fp8_get_tis_by_default(tmp_path: Path) -> None:
    """Experts are bf16 in the trainer and FP8 on fp8_block engines in both fp8_block
    arrangements, so a MoE checkpoint under --precision fp8 gets TIS like bf16-train-fp8-serve;
    with the experts kept bf16 (an override) or a dense model it does not."""
    args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4",
                         "--device", "cpu", "--precision", "fp8")
    (tmp_path / "model" / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_experts": 4, "num_hidden_layers": 2,
        "num_attention_heads": 4, "head_dim": 16}))
    assert load_config(None, args).ratio_correction == "tis"
    kept = load_config(None, [*args, "--precision-override", "*.experts.*=bf16"])
    assert kept.ratio_correction == "none"
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert load_config(None, args).ratio_correction == "none"
