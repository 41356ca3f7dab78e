"""`--offload-actor-for-critic` (issue 9, report 3.2): its default follows the critic and the
device, it reaches the trainer settings, and it is refused without a critic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost import config_rules
from milepost.config import ConfigError, load_config
from milepost.driver.trainer_settings import trainer_settings


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    model = tmp_path / "dense"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--num-rollout", "2",
            "--rollout-batch-size", "4", "--run-dir", str(tmp_path / "run")]


PPO = ["--advantage-estimator", "ppo", "--critic-lr", "1e-3"]


def test_default_is_on_with_a_critic_on_cuda_only(base: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_config(None, base + PPO + ["--device", "cpu"]).offload_actor_for_critic is False
    assert load_config(None, base + ["--device", "cpu"]).offload_actor_for_critic is False
    # No GPU on this machine: the device checks are told there are two, to resolve a cuda run.
    monkeypatch.setattr(config_rules, "_visible_gpus", lambda: 2)
    monkeypatch.setattr(config_rules, "_cuda_available", lambda: True)
    cuda = load_config(None, base + PPO + ["--device", "cuda", "--rollout-only"])
    assert cuda.offload_actor_for_critic is True and not cuda.colocate  # whatever the placement
    assert load_config(None, base + ["--device", "cuda", "--rollout-only"]).offload_actor_for_critic is False


def test_it_reaches_the_trainer_and_is_refused_without_a_critic(base: list[str]) -> None:
    on = load_config(None, base + PPO + ["--device", "cpu", "--offload-actor-for-critic", "true"])
    assert trainer_settings(on).actor_critic_turns is True
    off = load_config(None, base + PPO + ["--device", "cpu"])
    assert trainer_settings(off).actor_critic_turns is False
    with pytest.raises(ConfigError, match="--offload-actor-for-critic .* has no critic"):
        load_config(None, base + ["--device", "cpu", "--offload-actor-for-critic", "true"])
