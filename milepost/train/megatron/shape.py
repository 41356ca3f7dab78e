"""The model shape a Megatron GPTModel needs, read from a Hugging Face config (Llama, Qwen3, Qwen3-MoE).

Pure Python: conversion and size validation use it without megatron-core installed. Anything the
Megatron mapping does not cover (rope scaling, attention bias, shared experts) is refused here,
naming the config field, rather than converted into a different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED = ("llama", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    """Sizes and switches of one decoder-only model, in Hugging Face terms."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tied_embeddings: bool
    qk_layernorm: bool
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer: True = experts, False = dense MLP

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def _rope_theta(config: Any) -> float:
    params = _get(config, "rope_parameters") or {}
    scaling = _get(config, "rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise ValueError(f"rope type {kind!r}: the Megatron backend maps plain RoPE only (config rope_parameters / "
                         "rope_scaling); train this model with --train-backend fsdp")
    theta = params.get("rope_theta", _get(config, "rope_theta"))
    if theta is None:
        raise ValueError("config has no rope_theta (nor rope_parameters.rope_theta)")
    return float(theta)


def shape_of(config: Any) -> ModelShape:
    """The `ModelShape` of a transformers config object or a config.json dict; refuses what it cannot map."""
    model_type = _get(config, "model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type {model_type!r}: the Megatron backend supports {', '.join(SUPPORTED)}; "
                         "train other models with --train-backend fsdp")
    for flag in ("attention_bias", "mlp_bias"):
        if _get(config, flag):
            raise ValueError(f"config {flag}=true: the Megatron backend maps bias-free models only")
    heads = int(_get(config, "num_attention_heads"))
    hidden = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    moe: dict[str, Any] = {}
    if model_type == "qwen3_moe":
        if _get(config, "shared_expert_intermediate_size"):
            raise ValueError("config shared_expert_intermediate_size: shared experts are not mapped yet")
        dense = set(_get(config, "mlp_only_layers") or [])
        step = int(_get(config, "decoder_sparse_step", 1) or 1)
        moe = {
            "num_experts": int(_get(config, "num_experts") or _get(config, "num_local_experts")),
            "moe_top_k": int(_get(config, "num_experts_per_tok")),
            "moe_ffn_hidden_size": int(_get(config, "moe_intermediate_size")),
            "norm_topk_prob": bool(_get(config, "norm_topk_prob", True)),
            "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
        }
    return ModelShape(
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(_get(config, "num_key_value_heads") or heads),
        head_dim=int(_get(config, "head_dim") or hidden // heads),
        ffn_hidden_size=int(_get(config, "intermediate_size")),
        vocab_size=int(_get(config, "vocab_size")),
        rope_theta=_rope_theta(config),
        rms_norm_eps=float(_get(config, "rms_norm_eps")),
        max_position_embeddings=int(_get(config, "max_position_embeddings")),
        tied_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        **moe,
    )
