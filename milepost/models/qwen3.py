"""Qwen3 dense decoder: Llama's skeleton plus per-head RMSNorm on q and k before RoPE.

head_dim is explicit in the config (Qwen3-0.6B: 128 with hidden 1024, 16 heads), so it is never
derived from hidden_size. Sliding-window layers are refused rather than silently run as full attention.
"""

from __future__ import annotations

from typing import ClassVar

from milepost.models.llama import DecoderLM


def check_no_sliding_window(config: object) -> None:
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise ValueError(
            f"{type(config).__name__} with use_sliding_window=True is not supported by the native "
            "models; set use_sliding_window=false in config.json or use the transformers backend"
        )


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3ForCausalLM (q_norm / k_norm per head, explicit head_dim)."""

    qk_norm: ClassVar[bool] = True

    def check_config(self, config: object) -> None:
        check_no_sliding_window(config)
