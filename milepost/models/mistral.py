"""Mistral dense decoder: Llama's skeleton with an optional sliding window on every layer.

transformers applies config.sliding_window to all layers when it is set (Mistral 7B v0.1: 4096);
later Mistral checkpoints set it to null and run as plain Llama. A window at least as long as
max_position_embeddings never masks anything, so it is dropped rather than paid for.
"""

from __future__ import annotations

from milepost.models.llama import DecoderLM


class MistralForCausalLM(DecoderLM):
    """MistralForCausalLM: head_dim may differ from hidden_size / heads (Mistral Nemo: 128)."""

    def layer_window(self, config: object, layer_id: int) -> int | None:
        window = getattr(config, "sliding_window", None)
        if window is None or window >= config.max_position_embeddings:
            return None
        return int(window)
