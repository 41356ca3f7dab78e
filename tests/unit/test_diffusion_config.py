"""Diffusion run settings (milepost/diffusion/config.py): invalid combinations refused at start,
naming the setting; `milepost train` routes a recipe with a [diffusion] table to this loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.cli import main
from milepost.diffusion.config import is_diffusion_recipe, load_diffusion_config
from milepost.recipe import ConfigError

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "diffusion_tiny.toml"


@pytest.mark.parametrize(("flags", "message"), [
    (["--deterministic", "--attention-backend", "sdpa"], "no deterministic switch"),
    (["--diffusion-train-timesteps", "0,7"], "--diffusion-train-timesteps"),
    (["--diffusion-objective", "sft"], "--sft-data"),
    (["--n-samples-per-prompt", "1"], "--n-samples-per-prompt must be >= 2"),
    (["--param-dtype", "bfloat16"], "--trainer-backend fsdp2"),
    (["--reward-fn", "shape_classifier", "--classifier-path", "none"], "--classifier-path"),
    (["--reward-fn", "sparkle"], "module:function"),
    (["--noise-level", "0"], "--noise-level: Input should be greater than 0"),
    (["--quality-probe", "48", "--classifier-path", "none"], "--quality-probe needs --classifier-path"),
    (["--weight-transport", "p2p"], "--weight-transport p2p .* use broadcast"),
])
def test_bad_combinations_are_refused(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_diffusion_config(RECIPE, flags)


def test_recipe_loads_and_routes(capsys: pytest.CaptureFixture[str]) -> None:
    assert is_diffusion_recipe(RECIPE) and not is_diffusion_recipe(ROOT / "recipes" / "tiny_demo.toml")
    cfg = load_diffusion_config(RECIPE, ["--diffusion-train-timesteps", "0,2", "--device", "cpu"])
    assert cfg.diffusion_train_timesteps == [0, 2] and cfg.diffusion_objective == "flow_grpo"
    assert main(["train", str(RECIPE), "--print-config", "--lora-rank", "4"]) == 0
    out = capsys.readouterr().out
    assert "[diffusion]" in out and "lora_rank = 4" in out


def test_quality_probe_spreads_over_the_classes() -> None:
    from milepost.diffusion.quality import probe_groups

    assert probe_groups(48, 3) == [(0, 16), (1, 16), (2, 16)]
    assert probe_groups(7, 3) == [(0, 3), (1, 2), (2, 2)] and probe_groups(2, 3) == [(0, 1), (1, 1)]
