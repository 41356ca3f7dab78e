"""The contract between native model definitions and whoever runs them (engine or trainer).

A model is a plain `nn.Module` over a flat batch of tokens (no padding): `forward` takes
`input_ids: [T]`, `positions: [T]` and a `ForwardContext`, and returns hidden states `[T, hidden]`;
`compute_logits` turns selected hidden states into fp32 logits. Attention is delegated to the
context's backend (paged KV for the engine, packed/varlen for training), so the same model code
serves both. Weights are addressed by their Hugging Face names through `weight_view`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBackend(Protocol):
    """Computes attention for one layer of the current batch.

    The backend knows the batch layout (sequence boundaries, cached prefixes, KV slots) from
    whatever metadata it was prepared with before the forward pass; models only hand it q, k, v.
    """

    def attend(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q: [T, n_heads, head_dim], k/v: [T, n_kv_heads, head_dim] -> [T, n_heads, head_dim]."""
        ...


@dataclass
class ForwardContext:
    """Per-forward state handed down through the layers.

    routed_experts: optional out-buffer [T, num_layers, top_k] int32 that MoE layers fill with the
        expert ids they actually used for each token (dense layers leave their slice untouched).
    forced_experts: optional [T, num_layers, top_k] int64 expert ids to use instead of the router's
        own choice (rollout routing replay); the router still computes its scores for gradients.
    """

    attention: AttentionBackend
    routed_experts: torch.Tensor | None = None
    forced_experts: torch.Tensor | None = None
    # Set by DecoderLM's fused-residual path, where each attention and MLP output goes straight
    # into a fused residual add + RMSNorm: with lowprec/fp8_act.PARTS_TO_NORM their FP8
    # out-projections may hand back split-K parts for that kernel to sum (fp8_act.SplitSum).
    unsummed_outputs: bool = False


@runtime_checkable
class CausalLM(Protocol):
    """What every native model exposes (see milepost/models/registry.py for construction)."""

    hf_config: object  # the transformers PretrainedConfig the model was built from
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    moe_top_k: int  # 0 for dense models

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden states [T, hidden]."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in fp32."""
        ...

    def weight_view(self, hf_name: str) -> torch.Tensor:
        """The tensor (a view into a parameter) that the Hugging Face tensor `hf_name` fills.

        Raises KeyError with a helpful message for a name this model does not have. Callers check
        shape and dtype against the returned view before copying, so a bad update changes nothing.
        """
        ...

    def hf_weight_names(self) -> list[str]:
        """Every Hugging Face name a full checkpoint of this model provides (tied weights once)."""
        ...

    def hf_tensors(self, param_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Inverse of `weight_view` for one parameter: (hf_name, slice of `full`) pairs.

        `full` is the complete value of the parameter named `param_name` in `named_parameters()`
        (for example gathered from FSDP shards); over all parameters this covers
        `hf_weight_names()` exactly once.
        """
        ...
