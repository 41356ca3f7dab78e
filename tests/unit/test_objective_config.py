"""Objective settings of `milepost train` / `milepost sft`: refused at start, naming the setting."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.sft_config import load_sft_config


def _model(tmp_path: Path, name: str, **cfg: object) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(_model(tmp_path, "dense", model_type="qwen3")), "--prompt-data", str(prompts),
            "--num-rollout", "2", "--rollout-batch-size", "4", "--device", "cpu", "--run-dir", str(tmp_path / "run")]


def refused(base: list[str], *flags: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, base + list(flags))
    return str(e.value)


def test_unknown_estimator_and_ppo_without_critic_are_refused(base: list[str]) -> None:
    assert "--advantage-estimator" in refused(base, "--advantage-estimator", "ppo2")
    msg = refused(base, "--advantage-estimator", "ppo")
    assert "--advantage-estimator ppo" in msg and "--critic-lr" in msg
    assert "--critic-lr" in refused(base, "--critic-lr", "1e-3")  # a critic without ppo does nothing
    cfg = load_config(None, base + ["--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--n-samples-per-prompt", "1"])
    assert cfg.critic_lr == 1e-3 and cfg.loss_aggregation == "token_mean"
    assert "n-samples-per-prompt" in refused(base, "--advantage-estimator", "gspo", "--n-samples-per-prompt", "1")


def test_gspo_defaults_to_sequence_mean_and_kl_reward_needs_token_estimator(base: list[str]) -> None:
    assert load_config(None, base + ["--advantage-estimator", "gspo"]).loss_aggregation == "sequence_mean"
    assert "--kl-coef" in refused(base, "--kl-coef", "0.1")  # grpo: one advantage per sequence
    cfg = load_config(None, base + ["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.1",
                                    "--kl-loss-type", "low_var_kl"])
    assert cfg.kl_coef == 0.1 and cfg.kl_loss_type == "low_var_kl"


def test_loss_plugin_with_a_wrong_signature_is_refused(base: list[str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "objective_plugins.py").write_text(
        "def one_arg(batch):\n    return batch.logp.sum(), {}\n"
        "def good(batch, settings):\n    return batch.logp.sum(), {}\n"
        "def est_bad(samples):\n    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    msg = refused(base, "--loss-type", "custom_loss", "--custom-loss-function-path", "objective_plugins:one_arg")
    assert "--custom-loss-function-path 'objective_plugins:one_arg'" in msg and "signature" in msg
    assert "go together" in refused(base, "--loss-type", "custom_loss")
    load_config(None, base + ["--loss-type", "custom_loss", "--custom-loss-function-path", "objective_plugins:good"])
    assert "--advantage-estimator 'objective_plugins:est_bad'" in refused(
        base, "--advantage-estimator", "objective_plugins:est_bad")
    sys.modules.pop("objective_plugins", None)


def test_corrections_and_r3_combinations(base: list[str], tmp_path: Path) -> None:
    msg = refused(base, "--ratio-correction", "tis", "--use-rollout-logprobs")
    assert "--ratio-correction tis" in msg and "--use-rollout-logprobs" in msg
    assert "--tis-clip-low" in refused(base, "--ratio-correction", "clip_or_pop", "--tis-clip-low", "3")
    assert load_config(None, base + ["--ratio-correction", "tis"]).tis_clip == 2.0
    msg = refused(base, "--use-rollout-routing-replay")
    assert "--use-rollout-routing-replay" in msg and "dense model" in msg
    moe = _model(tmp_path, "moe", model_type="qwen3_moe", num_experts=4)
    i = base.index("--hf-checkpoint") + 1
    moe_base = base[:i] + [str(moe)] + base[i + 1:]
    load_config(None, moe_base + ["--use-rollout-routing-replay"])
    other = _model(tmp_path, "moe2", model_type="qwen3_moe", num_experts=8)
    msg = refused(moe_base, "--use-rollout-routing-replay", "--advantage-estimator", "ppo", "--critic-lr", "1e-3",
                  "--critic-hf-checkpoint", str(other))
    assert "--critic-hf-checkpoint" in msg


def test_sft_config_names_its_settings(tmp_path: Path) -> None:
    model = _model(tmp_path, "m", model_type="qwen3")
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    cfg = load_sft_config(None, ["--hf-checkpoint", str(model), "--sft-data", str(data), "--device", "cpu",
                                 "--run-dir", str(tmp_path / "r")])
    assert cfg.dtype == "float32" and cfg.global_batch_size == 32
    with pytest.raises(ConfigError, match="--sft-data"):
        load_sft_config(None, ["--hf-checkpoint", str(model), "--sft-data", str(tmp_path / "none.jsonl")])
    with pytest.raises(ConfigError, match="actor-num-gpus-per-node"):
        load_sft_config(None, ["--hf-checkpoint", str(model), "--sft-data", str(data), "--global-batch-size", "3",
                               "--actor-num-gpus-per-node", "2"])
