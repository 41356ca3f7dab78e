"""Gemma 2 and Gemma 3 (text) decoders on the shared skeleton (`DecoderLM`).

What differs from Llama: RMSNorm scales by (1 + weight) in fp32 before the cast; four norms per
layer (before and after attention and MLP); embeddings scaled by sqrt(hidden) in the model dtype;
GELU (tanh) MLP; attention scaled by query_pre_attn_scalar^-0.5; sliding and global layers per
config.layer_types. Gemma 2 soft-caps attention logits and the final logits; Gemma 3 normalizes
q and k per head and gives each layer type its own RoPE base. Soft-capped and windowed layers
attend through masked_attention.py (torch ops); the others keep the fast backends.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from milepost.models.base import ForwardContext
from milepost.models.layers import GatedMLP, RotaryEmbedding
from milepost.models.llama import DecoderLM
from milepost.models.qwen3 import window_from_layer_types


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), all in fp32, then cast (transformers' Gemma order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GeluMLP(GatedMLP):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)); fuses gate/up like GatedMLP."""

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class PerTypeRotary(nn.Module):
    """One RotaryEmbedding per layer type (Gemma 3: sliding layers at base 10k, global at 1M)."""

    def __init__(self, config: object, head_dim: int) -> None:
        super().__init__()
        nested = config.rope_parameters
        self.tables = {kind: RotaryEmbedding(SimpleNamespace(rope_parameters=dict(nested[kind]),
                                                             max_position_embeddings=config.max_position_embeddings),
                                             head_dim)
                       for kind in sorted(set(config.layer_types))}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: table(positions, dtype) for kind, table in self.tables.items()}


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms: h = x + post_attn(attn(in(x))); out = h + post_ff(mlp(pre_ff(h)))."""

    def __init__(self, base: nn.Module, config: object) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn, self.mlp = base.self_attn, base.mlp
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), ctx))


class _Gemma(DecoderLM):
    """Shared by Gemma 2 and Gemma 3; subclasses set the q/k norm and what varies per layer type."""

    per_type_rope: ClassVar[bool] = False

    def __init__(self, config: object) -> None:
        super().__init__(config)
        eps = config.rms_norm_eps
        layers = []
        for i, base in enumerate(self.model.layers):
            attn = base.self_attn
            attn.scale = float(config.query_pre_attn_scalar) ** -0.5
            attn.softcap = getattr(config, "attn_logit_softcapping", None)
            attn.fused_norm_rope = False  # Gemma's (1 + weight) q/k norms
            if self.qk_norm:
                attn.q_norm, attn.k_norm = GemmaRMSNorm(self.head_dim, eps), GemmaRMSNorm(self.head_dim, eps)
            layers.append(GemmaDecoderLayer(base, config))
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = GemmaRMSNorm(config.hidden_size, eps)
        self.layer_types = list(config.layer_types)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.uses_variant_attention = any(
            layer.self_attn.window is not None or layer.self_attn.softcap is not None for layer in self.model.layers)

    def check_activation(self, config: object) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={act!r} is not implemented by native Gemma (only 'gelu_pytorch_tanh')")

    def check_config(self, config: object) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("config.use_bidirectional_attention is true (non-causal attention is not served)")

    def layer_window(self, config: object, layer_id: int) -> int | None:
        return window_from_layer_types(config, layer_id)

    def make_mlp(self, config: object, layer_id: int) -> nn.Module:
        return GeluMLP(config.hidden_size, config.intermediate_size)

    def make_rotary(self, config: object) -> nn.Module:
        return PerTypeRotary(config, self.head_dim) if self.per_type_rope else super().make_rotary(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)  # rounded to the model dtype, as transformers does
        tables = self.rotary(positions, h.dtype)
        for layer, kind in zip(self.model.layers, self.layer_types):
            cos, sin = tables[kind] if isinstance(tables, dict) else tables
            h = layer(h, cos, sin, ctx)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()


class Gemma2ForCausalLM(_Gemma):
    """Gemma2ForCausalLM: attention and final logit soft-capping, no q/k norm, one RoPE base."""


class Gemma3ForCausalLM(_Gemma):
    """Gemma3ForCausalLM (text): q/k norms, a RoPE base per layer type."""

    qk_norm: ClassVar[bool] = True
    per_type_rope: ClassVar[bool] = True
