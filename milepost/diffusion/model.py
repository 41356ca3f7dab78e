"""A tiny class-conditional DiT giving the flow-matching velocity v = noise - x0.

It predicts the clean image and returns v = (x_t - x0_hat) / t (x-prediction). Patchified 32x32 RGB, adaLN-zero blocks, a null class for classifier-free guidance. Saved as a
directory (config.json + model.safetensors) that the engine and the trainer both load. Module
names that FP32-by-name rules match: `t_embedder`, `*.adaLN_modulation` (the modulation tables).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ATTENTION_BACKENDS = ("math", "sdpa")
T_MIN = 0.05  # v = (x_t - x0_hat) / t is formed with t at least this (no blow-up at the last step)  # math: one fixed kernel (deterministic); sdpa: torch picks


@dataclass(frozen=True)
class DiTConfig:
    image_size: int = 32
    channels: int = 3
    patch: int = 4
    dim: int = 64
    depth: int = 3
    heads: int = 4
    num_classes: int = 3
    model_type: str = "milepost_tiny_dit"

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


def _timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t in [0, 1] (scaled by 1000 as SD3 does with its sigmas). [B, dim]"""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = _timestep_features(t, self.dim).to(self.mlp[0].weight.dtype)
        return self.mlp(feats)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.attention = "math"

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c = c.to(self.adaLN_modulation[1].weight.dtype)
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).to(x.dtype)[:, None].chunk(6, dim=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention == "math":
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                a = F.scaled_dot_product_attention(q, k, v)
        else:
            a = F.scaled_dot_product_attention(q, k, v)
        x = x + gate1 * self.proj(a.transpose(1, 2).reshape(b, n, d))
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c = c.to(self.adaLN_modulation[1].weight.dtype)
        shift, scale = self.adaLN_modulation(c).to(x.dtype)[:, None].chunk(2, dim=-1)
        return self.linear(self.norm(x) * (1 + scale) + shift)


class TinyDiT(nn.Module):
    """v = model(x_t [B,C,H,W], t [B] in [0,1], labels [B] int; label num_classes = unconditional)."""

    def __init__(self, config: DiTConfig) -> None:
        super().__init__()
        self.config = config
        p, d = config.patch, config.dim
        self.patch_embed = nn.Linear(config.channels * p * p, d)
        self.pos_embed = nn.Parameter(torch.zeros(1, config.tokens, d))
        self.t_embedder = TimestepEmbedder(d)
        self.y_embedder = nn.Embedding(config.num_classes + 1, d)  # last row: the null class
        self.blocks = nn.ModuleList(Block(d, config.heads) for _ in range(config.depth))
        self.final_layer = FinalLayer(d, config.channels * p * p)
        self._init()

    def _init(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.y_embedder.weight, std=0.02)
        for block in [*self.blocks, self.final_layer]:  # adaLN-zero: each block starts as identity
            nn.init.zeros_(block.adaLN_modulation[1].weight)
            nn.init.zeros_(block.adaLN_modulation[1].bias)
        nn.init.zeros_(self.final_layer.linear.weight)

    def set_attention(self, backend: str) -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of {ATTENTION_BACKENDS}")
        for block in self.blocks:
            block.attention = backend

    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """The class embedding [B, dim] (the 'text encoder' output a microgroup shares)."""
        return self.y_embedder(labels)

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None = None,
                cond: torch.Tensor | None = None) -> torch.Tensor:
        cfg, p = self.config, self.config.patch
        b, g = x.shape[0], cfg.image_size // p
        tokens = x.reshape(b, cfg.channels, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, -1)
        dtype = self.patch_embed.weight.dtype
        h = self.patch_embed(tokens.to(dtype)) + self.pos_embed.to(dtype)
        if cond is None:
            cond = self.condition(labels)
        c = self.t_embedder(t) + cond.to(self.t_embedder.mlp[0].weight.dtype)
        h = h + cond.to(dtype)[:, None]  # the class on every token too: a stronger signal early in training
        for block in self.blocks:
            h = block(h, c)
        out = self.final_layer(h, c).float()
        x0_hat = out.reshape(b, g, g, cfg.channels, p, p).permute(0, 3, 1, 4, 2, 5).reshape(x.shape)
        # x-prediction (Li and He 2025, "Back to Basics"): a width-32 token cannot carry a 48-value
        # patch of noise through, but it can carry the clean image; v follows from x_t and x0_hat.
        return (x.float() - x0_hat) / t.float().clamp(min=T_MIN).reshape(-1, 1, 1, 1)


def save_model(model: TinyDiT, path: str | Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(asdict(model.config), indent=2) + "\n")
    state = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE))
    return path


def load_model(path: str | Path, device: str | torch.device = "cpu") -> TinyDiT:
    """A TinyDiT directory, or a diffusers flow-matching pipeline directory (milepost/diffusion/hf.py);
    ValueError naming the directory when it is neither."""
    from safetensors.torch import load_file

    path = Path(path)
    from milepost.diffusion.hf import is_diffusers_dir, load_pipeline_model

    if is_diffusers_dir(path):  # a diffusers pipeline (model_index.json): its transformer behind this interface
        return load_pipeline_model(path, device)  # type: ignore[return-value]
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a tiny DiT directory (needs {CONFIG_FILE} and {WEIGHTS_FILE}); "
                         "build one with `python -m milepost.diffusion.prepare DIR`")
    raw = json.loads((path / CONFIG_FILE).read_text())
    if raw.get("model_type") != DiTConfig.model_type:
        raise ValueError(f"{path}/{CONFIG_FILE}: model_type {raw.get('model_type')!r} is not "
                         f"{DiTConfig.model_type!r} (a diffusers pipeline needs a flow-matching scheduler; "
                         "see docs/diffusion.md)")
    model = TinyDiT(DiTConfig(**raw))
    model.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    return model.to(device)
