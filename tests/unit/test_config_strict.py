"""Strict config types: a recipe's "8" is not 8 and "yes" is not true; no NaN or infinity in a
float setting; command-line text still becomes the field's type; an empty path is named as such."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.sft_config import load_sft_config


@pytest.fixture
def recipe(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')

    def write(extra: str = "") -> Path:
        path = tmp_path / "r.toml"
        batch = "" if extra.startswith("rollout_batch_size") else "rollout_batch_size = 4\n"
        path.write_text(f'hf_checkpoint = "{model}"\nprompt_data = "{prompts}"\nnum_rollout = 2\n'
                        f'device = "cpu"\nrun_dir = "{tmp_path / "run"}"\n{batch}{extra}\n')
        return path

    return write


def test_typed_recipe_loads(recipe) -> None:
    cfg = load_config(recipe("rollout_batch_size = 8\ncolocate = false\nlr = 1e-5"))
    assert cfg.rollout_batch_size == 8 and cfg.lr == 1e-5 and cfg.colocate is False


@pytest.mark.parametrize("line, flag", [
    ('rollout_batch_size = "8"', "--rollout-batch-size"),
    ('colocate = "yes"', "--colocate"),
    ("colocate = 1", "--colocate"),
    ("rollout_batch_size = 8.0", "--rollout-batch-size"),
    ("rollout_batch_size = true", "--rollout-batch-size"),
    ('lr = "1e-5"', "--lr"),
    ("lr = inf", "--lr"),
    ("lr = nan", "--lr"),
    ("rollout_temperature = -inf", "--rollout-temperature"),
])
def test_recipe_values_of_the_wrong_type_are_refused(recipe, line, flag) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}: Input should be a (valid|finite)") as err:
        load_config(recipe(line))
    assert len(str(err.value).splitlines()) == 1  # that setting alone is at fault


def test_command_line_text_becomes_the_field_type(recipe) -> None:
    cfg = load_config(recipe(), ["--rollout-batch-size", "8", "--lr", "2e-6", "--colocate",
                                 "false"])
    assert cfg.rollout_batch_size == 8 and cfg.lr == 2e-6 and cfg.colocate is False
    for flags, msg in ((["--rollout-batch-size", "eight"], "--rollout-batch-size takes an integer"),
                       (["--rollout-batch-size", "8.5"], "--rollout-batch-size takes an integer"),
                       (["--lr", "fast"], "--lr takes a number"),
                       (["--lr", "inf"], "--lr: Input should be a finite number"),
                       (["--lr", "nan"], "--lr: Input should be a finite number"),
                       (["--eval-prompt-data", ""], "--eval-prompt-data is empty")):
        with pytest.raises(ConfigError, match=msg):
            load_config(recipe(), flags)


def test_sft_config_is_strict_too(recipe, tmp_path: Path) -> None:
    data = tmp_path / "sft.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    model = tmp_path / "model"
    base = ["--hf-checkpoint", str(model), "--device", "cpu", "--run-dir", str(tmp_path / "s")]
    with pytest.raises(ConfigError, match="--lr: Input should be a finite number"):
        load_sft_config(None, [*base, "--lr", "inf"])


def test_a_resolved_config_with_an_api_key_is_private(recipe, tmp_path: Path) -> None:
    with_key = load_config(recipe('api_key = "0123456789abcdef"'))
    written = with_key.write_resolved(tmp_path / "a")
    assert written.stat().st_mode & 0o077 == 0
    assert load_config(written).api_key == "0123456789abcdef"
    with pytest.raises(ConfigError, match="--api-key"):  # too short to be a key
        load_config(recipe('api_key = "abc"'))
