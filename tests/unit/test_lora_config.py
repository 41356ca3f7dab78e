"""LoRA run settings: defaults reach the trainer and the engine command; bad combinations refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.driver.runtime import trainer_settings
from milepost.launch.local import LocalLauncher
from milepost.testing.run_args import stub_run_args


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    return stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--device", "cpu")


def test_lora_settings_reach_trainer_and_engines(base: list[str]) -> None:
    cfg = load_config(None, [*base, "--lora-rank", "8", "--lora-alpha", "16",
                             "--lora-target-modules", "q_proj,v_proj"])
    lora = trainer_settings(cfg).lora
    assert lora is not None and (lora.rank, lora.alpha, lora.target_modules) == (8, 16.0, ("q_proj", "v_proj"))
    cmd = LocalLauncher(cfg, cfg.run_dir)._engine_cmd(12345)
    assert cmd.count("--enable-lora") == 1
    i = cmd.index("--enable-lora")
    assert cmd[i + 1 : i + 5] == ["--max-lora-rank", "8", "--lora-target-modules", "q_proj,v_proj"]
    assert trainer_settings(load_config(None, base)).lora is None  # rank 0: full training
    assert "--enable-lora" not in LocalLauncher(load_config(None, base), Path("unused"))._engine_cmd(12345)


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora-target-modules", "q_proj,lm_head"], r"unknown module\(s\) \['lm_head'\]"),
    (["--update-weight-transfer-mode", "p2p"], "p2p does not carry LoRA adapters"),
    (["--update-weight-transfer-mode", "disk-delta"], "disk-delta does not carry LoRA adapters"),
    (["--fully-async"], "--lora-rank with --fully-async is not supported yet"),
    (["--engine-quantization", "fp8"], "adapters on a quantized base are not served yet"),
    (["--use-session-server", "--session-model-family", "qwen3"], "session server is not supported yet"),
])
def test_lora_refusals_name_the_setting(base: list[str], flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, "--lora-rank", "4", *flags])
    with pytest.raises(ConfigError, match="--lora-rank"):
        load_config(None, [*base, "--lora-rank", "-1"])


def test_models_lora_cannot_adapt_refused_at_start(tmp_path: Path) -> None:
    """Before any process starts: MoE experts as targets, and a transformers-fallback architecture."""
    import json

    from milepost.testing.checkpoints import make_tiny_checkpoint

    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4", "--device", "cpu")
    args[1] = str(moe)
    with pytest.raises(ConfigError, match="gate_proj: layer 0 .*mixture-of-experts layers is not supported"):
        load_config(None, [*args, "--lora-rank", "4"])
    load_config(None, [*args, "--lora-rank", "4", "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj"])
    args[1] = str(tmp_path / "mixtral")
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(
        {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(ConfigError, match="--lora-rank: .*mixtral has no native model definition"):
        load_config(None, [*args, "--lora-rank", "4", "--lora-target-modules", "q_proj"])
