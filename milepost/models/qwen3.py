"""Qwen3 dense decoder: Llama's skeleton plus per-head RMSNorm on q and k before RoPE.

head_dim is explicit in the config (Qwen3-0.6B: 128 with hidden 1024, 16 heads), so it is never
derived from hidden_size. Sliding-window layers (config.layer_types, as transformers reads them)
attend through masked_attention.py: exact, but on torch ops rather than the Triton kernels.
"""

from __future__ import annotations

from typing import ClassVar

from milepost.models.llama import DecoderLM

_LAYER_TYPES = ("full_attention", "sliding_attention")


def window_from_layer_types(config: object, layer_id: int) -> int | None:
    """transformers' Qwen2/Qwen3 rule: config.sliding_window on layers typed "sliding_attention"."""
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return None
    kind = layer_types[layer_id]
    if kind not in _LAYER_TYPES:
        raise ValueError(f"config.layer_types[{layer_id}] = {kind!r} is not implemented natively "
                         f"(only {list(_LAYER_TYPES)})")
    return config.sliding_window if kind == "sliding_attention" else None


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3ForCausalLM (q_norm / k_norm per head, explicit head_dim)."""

    qk_norm: ClassVar[bool] = True

    def layer_window(self, config: object, layer_id: int) -> int | None:
        return window_from_layer_types(config, layer_id)
