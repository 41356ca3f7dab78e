"""Rotary position embeddings as transformers computes them: default, linear, llama3 and YaRN.

`rope_inv_freq` gives the frequencies, `rope_attention_factor` the factor cos/sin carry (YaRN's
temperature), `RotaryEmbedding` the tables per position, `apply_rotary` the rotate-half rotation.
Any other rope type is refused naming config.rope_parameters (the model then falls back).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: object) -> dict:
    """The RoPE settings of an HF config as one flat dict with at least rope_type and rope_theta.

    transformers 5 stores them in `config.rope_parameters`; 4.x used `rope_theta` + `rope_scaling`.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_inv_freq(config: object, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32 for the rope types of SUPPORTED_ROPE_TYPES."""
    p = rope_parameters(config)
    rope_type = p["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} (config.rope_parameters) is not implemented natively; "
                         f"implemented: {SUPPORTED_ROPE_TYPES}")
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config partial_rotary_factor != 1.0 is not implemented by the native models")
    # Explicit CPU: models may be built under a meta-device context; frequencies must be real.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (float(p["rope_theta"]) ** exponents)
    if rope_type == "linear":  # positions divided by `factor` (Gemma 3's global layers)
        inv_freq = inv_freq / float(p["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly, relative to the pretraining context length.
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_ctx = float(p.get("original_max_position_embeddings") or config.max_position_embeddings)
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv_freq = torch.where(in_band, blended, scaled)
    if rope_type == "yarn":
        inv_freq = _yarn(p, config, head_dim, inv_freq)
    return inv_freq


def _yarn_factor(p: dict, config: object) -> float:
    factor = p.get("factor")
    return float(factor) if factor is not None else config.max_position_embeddings / p["original_max_position_embeddings"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(p: dict, config: object, dim: int, extrapolation: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the pretraining context are
    interpolated by `factor`, more than beta_fast kept, a linear ramp between (transformers' rule)."""
    factor, base = _yarn_factor(p, config), float(p["rope_theta"])
    old_ctx = p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return extrapolation / factor * (1 - keep) + extrapolation * keep


def rope_attention_factor(config: object) -> float:
    """What cos/sin are multiplied by (YaRN's attention temperature; 1.0 for the other types)."""
    p = rope_parameters(config)
    if p["rope_type"] != "yarn":
        return 1.0
    factor = _yarn_factor(p, config)
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables [T, head_dim] for absolute positions; applied with the rotate-half convention."""

    def __init__(self, config: object, head_dim: int) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `model.to(bf16)` must not round the frequencies.
        self._inv_freq = rope_inv_freq(config, head_dim)
        self.attention_factor = rope_attention_factor(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], cos/sin: [T, head_dim] -> rotated x."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
