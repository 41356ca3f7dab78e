"""diffusers pipelines behind the diffusion engine (milepost/diffusion/hf.py): a pipeline that is
not flow matching, or not SD3-style, or has no prompts, is refused by name before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.diffusion.config import load_diffusion_config
from milepost.diffusion.model import load_model
from milepost.recipe import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _pipeline_dir(tmp_path: Path, scheduler: str = "FlowMatchEulerDiscreteScheduler",
                  pipeline: str = "StableDiffusion3Pipeline", prompts: bool = True) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": pipeline, "_diffusers_version": "0.42.1", "scheduler": ["diffusers", scheduler],
             "transformer": ["diffusers", "SD3Transformer2DModel"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    if prompts:
        (tmp_path / "prompts.txt").write_text("a red circle\n")
    return tmp_path


@pytest.mark.parametrize(("kw", "message"), [
    ({"scheduler": "DDPMScheduler", "pipeline": "StableDiffusionPipeline"}, "'DDPMScheduler', not a flow-matching scheduler"),
    ({"scheduler": "DDIMScheduler"}, "DDPM / DDIM / UNet pipeline cannot be trained"),
    ({"pipeline": "FluxPipeline"}, "pipeline 'FluxPipeline' is not supported"),
    ({"prompts": False}, "prompts.txt is missing"),
])
def test_pipelines_that_cannot_be_trained_are_refused(tmp_path: Path, kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(_pipeline_dir(tmp_path / "p", **kw))


def test_engine_refuses_a_ddpm_pipeline_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from milepost.diffusion.server import main

    with pytest.raises(SystemExit):
        main(["--model-path", str(_pipeline_dir(tmp_path / "p", scheduler="DDPMScheduler")), "--port", "1"])
    assert "not a flow-matching scheduler" in capsys.readouterr().err


def test_sft_on_a_pipeline_is_refused(tmp_path: Path) -> None:
    flags = ["--diffusion-checkpoint", str(_pipeline_dir(tmp_path / "p")), "--diffusion-objective", "sft",
             "--sft-data", str(tmp_path / "x.npz")]
    with pytest.raises(ConfigError, match="trains on VAE latents"):
        load_diffusion_config(ROOT / "recipes" / "diffusion_tiny.toml", flags)
