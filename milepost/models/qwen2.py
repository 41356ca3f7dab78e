"""Qwen2 / Qwen2.5 dense decoder: Llama's skeleton with a bias on q/k/v (not on o_proj).

No q/k norm (that is Qwen3's addition). Sliding-window layers follow config.layer_types like
Qwen3's (qwen3.py); transformers computes them from use_sliding_window and max_window_layers.
"""

from __future__ import annotations

from typing import ClassVar

from milepost.models.llama import DecoderLM
from milepost.models.qwen3 import window_from_layer_types


class Qwen2ForCausalLM(DecoderLM):
    """Qwen2ForCausalLM: q/k/v_proj with bias, o_proj and the MLP without."""

    qkv_bias: ClassVar[bool | None] = True

    def layer_window(self, config: object, layer_id: int) -> int | None:
        return window_from_layer_types(config, layer_id)
