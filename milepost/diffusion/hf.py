"""Hugging Face `diffusers` flow-matching pipelines (SD3-style transformers) behind the tiny DiT's interface.

The engine, sampler, objectives and trainer call `condition(labels)`, `forward(x, t, cond=...)`
and `config`; this wrapper gives them for a StableDiffusion3Pipeline directory. A class label picks
a prompt (one per line in prompts.txt; label num_classes is the empty prompt, SD3's unconditional
input for CFG). Only the transformer is trained and travels in weight updates; the text encoders
and the VAE stay frozen outside the state dict (shared, not copied, by the reference model). The
sampler works in latent space; `decode` turns the last latents into images for the rewards.
A pipeline whose scheduler is not flow matching (DDPM, DDIM, ...) is refused: Flow-GRPO's SDE
and the velocity convention v = noise - x0 are defined for rectified flow only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

INDEX_FILE = "model_index.json"
PROMPTS_FILE = "prompts.txt"
FLOW_SCHEDULERS = ("FlowMatchEulerDiscreteScheduler",)
PIPELINES = ("StableDiffusion3Pipeline",)
MAX_SEQUENCE_LENGTH = 77  # T5 tokens per prompt (SD3 allows 256; class prompts are short)


def is_diffusers_dir(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def check_pipeline(path: str | Path) -> dict:
    """model_index.json of a trainable pipeline; ValueError naming the pipeline or scheduler otherwise."""
    path = Path(path)
    index = json.loads((path / INDEX_FILE).read_text())
    pipeline = index.get("_class_name")
    scheduler = (index.get("scheduler") or [None, None])[1]
    if scheduler not in FLOW_SCHEDULERS:
        raise ValueError(f"{path}: the pipeline's scheduler is {scheduler!r}, not a flow-matching scheduler "
                         f"{FLOW_SCHEDULERS}; Flow-GRPO's SDE and DiffusionNFT need a rectified-flow model "
                         "(a DDPM / DDIM / UNet pipeline cannot be trained here)")
    if pipeline not in PIPELINES:
        raise ValueError(f"{path}: pipeline {pipeline!r} is not supported; supported: {PIPELINES} "
                         "(SD3-style transformer, FlowMatchEulerDiscreteScheduler)")
    if not (path / PROMPTS_FILE).is_file():
        raise ValueError(f"{path}/{PROMPTS_FILE} is missing: write one prompt per line (class label i = line i)")
    return index


@dataclass(frozen=True)
class PipelineConfig:
    image_size: int  # latent height = width
    channels: int  # latent channels
    num_classes: int  # prompts; label num_classes = the empty prompt
    pixel_size: int
    model_type: str = "diffusers_sd3"


class _Frozen:
    """Holds the pipeline's frozen parts; deepcopy (the reference model) shares them."""

    def __init__(self, pipe: object) -> None:
        self.pipe = pipe

    def __deepcopy__(self, memo: dict) -> _Frozen:
        return self


class DiffusersFlowModel(nn.Module):
    """v = model(x_t [B,16,h,w] latents, t [B] in [0,1], labels [B]) through an SD3 transformer."""

    def __init__(self, pipe: object, prompts: list[str]) -> None:
        super().__init__()
        self.transformer = pipe.transformer  # type: ignore[attr-defined]
        self.frozen = _Frozen(pipe)
        self.prompts = prompts
        tc = self.transformer.config
        scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)  # type: ignore[attr-defined]
        self.config = PipelineConfig(image_size=tc.sample_size, channels=tc.in_channels, num_classes=len(prompts),
                                     pixel_size=tc.sample_size * scale)
        self.attention = "math"
        self._cond: dict[tuple[int, str], torch.Tensor] = {}

    fsdp_cast_inputs = True  # FSDP2's BF16 policy casts each unit's inputs (milepost/diffusion/precision.py)

    @property
    def blocks(self) -> nn.ModuleList:  # FSDP2 wraps each block (milepost/diffusion/precision.py)
        return self.transformer.transformer_blocks

    def lora_targets(self) -> list[str]:
        """Attention projections of every block (the usual SD3 LoRA targets)."""
        return [n for n, m in self.named_modules() if isinstance(m, nn.Linear) and ".transformer_blocks." in f".{n}"
                and n.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")]

    def set_attention(self, backend: str) -> None:
        if backend not in ("math", "sdpa"):
            raise ValueError(f"attention backend {backend!r} is not one of ('math', 'sdpa')")
        self.attention = backend

    def _device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @torch.no_grad()
    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """[B, S*D + P]: SD3's prompt embeddings and pooled projections of each label's prompt, flattened
        into one row (the samplers batch, expand and concatenate conditions as rows). Cached per label:
        the text encoders never change."""
        dev = self._device()
        rows = []
        for label in labels.tolist():
            key = (int(label), str(dev))
            if key not in self._cond:
                prompt = self.prompts[label] if label < len(self.prompts) else ""
                embeds, _, pooled, _ = self.frozen.pipe.encode_prompt(  # type: ignore[attr-defined]
                    prompt=prompt, prompt_2=None, prompt_3=None, device=dev, do_classifier_free_guidance=False,
                    max_sequence_length=MAX_SEQUENCE_LENGTH)
                self._cond[key] = torch.cat([embeds.reshape(-1), pooled.reshape(-1)]).float()
            rows.append(self._cond[key])
        return torch.stack(rows).to(dev)

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None,
                cond: torch.Tensor | None = None) -> torch.Tensor:
        if cond is None:
            cond = self.condition(labels)  # type: ignore[arg-type]
        tc = self.transformer.config
        pooled_dim = tc.pooled_projection_dim
        b = x.shape[0]
        embeds = cond[:, :-pooled_dim].reshape(b, -1, tc.joint_attention_dim)
        dtype = next(self.transformer.parameters()).dtype
        args = {"hidden_states": x.to(dtype), "encoder_hidden_states": embeds.to(dtype),
                "pooled_projections": cond[:, -pooled_dim:].to(dtype), "timestep": (t.float() * 1000.0).expand(b)}
        if self.attention == "math":
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                return self.transformer(**args).sample.float()
        return self.transformer(**args).sample.float()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [B,3,H,W] in [-1,1] from clean latents (SD3's scaling and shift undone)."""
        vae = self.frozen.pipe.vae  # type: ignore[attr-defined]
        z = latents.to(self._device(), vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        return vae.decode(z).sample.float().clamp(-1, 1).cpu()


def load_pipeline_model(path: str | Path, device: str | torch.device = "cpu") -> DiffusersFlowModel:
    """A DiffusersFlowModel from a pipeline directory (checked first: see check_pipeline)."""
    check_pipeline(path)
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as dlogging
    from transformers.utils import logging as tlogging

    dlogging.disable_progress_bar()  # one bar per component drowns the engine log
    tlogging.disable_progress_bar()
    pipe = DiffusionPipeline.from_pretrained(str(path), dtype=torch.float32)
    pipe.to(device)
    for part in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if part is not None:
            part.requires_grad_(False).eval()
    prompts = [line.strip() for line in (Path(path) / PROMPTS_FILE).read_text().splitlines() if line.strip()]
    return DiffusersFlowModel(pipe, prompts)
