"""Trainer speed defaults chosen by measurement (docs/training_speed.md) and how they reach the trainer.

`--max-tokens-per-micro-batch` unset resolves to 16384 tokens on CUDA and 4096 on CPU (unchanged
there, so CPU runs and their recorded metrics stay as they were); `--fused-kernels` (on) and an
explicit budget pass through to `TrainerSettings` for RL and SFT alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import milepost.config_rules as rules
from milepost.config import load_config
from milepost.driver.trainer_settings import trainer_settings
from milepost.testing.run_args import stub_run_args
from milepost.train.settings import TrainerSettings


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    return stub_run_args(tmp_path, "--num-rollout", "1", "--rollout-batch-size", "4")


def test_micro_batch_budget_follows_the_device(base: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = load_config(None, [*base, "--device", "cpu"])
    assert cpu.max_tokens_per_micro_batch == 4096 and cpu.fused_kernels
    monkeypatch.setattr(rules, "_cuda_available", lambda: True)
    monkeypatch.setattr(rules, "_visible_gpus", lambda: 2)
    cuda = load_config(None, [*base, "--device", "cuda"])
    assert cuda.max_tokens_per_micro_batch == 16384
    settings = trainer_settings(cuda)
    assert settings.max_tokens_per_micro_batch == 16384 and settings.fused_kernels
    given = load_config(None, [*base, "--device", "cuda", "--max-tokens-per-gpu", "2048", "--no-fused-kernels"])
    settings = trainer_settings(given)
    assert settings.max_tokens_per_micro_batch == 2048 and not settings.fused_kernels


def test_sft_resolves_the_same_budget(tmp_path: Path) -> None:
    from milepost.sft_config import SFTConfig
    from milepost.train.sft import sft_trainer_settings

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    data = tmp_path / "sft.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = SFTConfig(hf_checkpoint=model, sft_data=data, device="cpu", run_dir=tmp_path / "run")
    assert cfg.max_tokens_per_micro_batch == 4096
    assert sft_trainer_settings(cfg, 1).fused_kernels


def test_trainer_settings_default_is_the_measured_budget() -> None:
    assert TrainerSettings().max_tokens_per_micro_batch == 16384
    assert TrainerSettings().fused_kernels
