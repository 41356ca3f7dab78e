"""Llama-family decoder (SmolLM2 and friends) and `DecoderLM`, the skeleton Qwen3 models reuse.

Module and parameter names mirror transformers' (`model.layers.N.self_attn.q_proj.weight`, ...) so
a dense model's state dict *is* its Hugging Face checkpoint; `weight_view` only has to resolve
tied embeddings (and, in the MoE subclass, per-expert slices of stacked expert weights).
"""

from __future__ import annotations

import difflib
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from milepost.models.base import ForwardContext
from milepost.models.layers import (
    DecoderLayer,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    add_norm_for,
    check_silu,
    fuse_linears,
    fused_residuals,
    norm_for,
)


class DecoderLM(nn.Module):
    """Embedding, pre-norm decoder layers, final norm, LM head. Subclasses pick q/k norm and MLPs."""

    qk_norm: ClassVar[bool] = False
    qkv_bias: ClassVar[bool | None] = None  # None: config.attention_bias decides (q/k/v and o)
    native: ClassVar[bool] = True

    def __init__(self, config: object) -> None:
        super().__init__()
        self.check_activation(config)
        self.check_config(config)
        self.hf_config = config
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = config.num_key_value_heads
        heads = config.num_attention_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.vocab_size: int = config.vocab_size
        self.moe_top_k: int = 0
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, i, self.qk_norm, self.make_mlp(config, i), self.qkv_bias, self.layer_window(config, i))
            for i in range(self.num_layers)
        )
        # Windowed layers attend through masked_attention.py: the engine wraps its backend for them.
        self.uses_variant_attention = any(layer.self_attn.window is not None for layer in self.model.layers)
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = self.make_rotary(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._hf_names: list[str] | None = None
        self._hf_name_set: frozenset[str] = frozenset()
        # After fuse_projections: HF name -> (fused parameter, first row, end row), and back.
        self._fused: dict[str, tuple[str, int, int]] = {}
        self._fused_parts: dict[str, list[tuple[str, int, int]]] = {}

    def check_activation(self, config: object) -> None:
        """Refuse an MLP activation this definition does not implement (override per architecture)."""
        check_silu(config)

    def check_config(self, config: object) -> None:
        """Refuse config features this definition does not implement (override per architecture)."""

    def make_rotary(self, config: object) -> nn.Module:
        """The RoPE tables' module (Gemma 3 overrides it: one base per layer type)."""
        return RotaryEmbedding(config, self.head_dim)

    def layer_window(self, config: object, layer_id: int) -> int | None:
        """Sliding window of layer `layer_id` in tokens, None for full attention (override)."""
        return None

    def make_mlp(self, config: object, layer_id: int) -> nn.Module:
        bias = bool(getattr(config, "mlp_bias", False))
        return GatedMLP(config.hidden_size, config.intermediate_size, bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final-normed hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)  # computed once, shared by every layer
        layers = self.model.layers
        if fused_residuals(layers, self.model.norm, h):
            # GPU inference: each residual add inside the next RMSNorm's kernel (same values);
            # a norm feeding an FP8 linear quantizes its output there too (lowprec/fp8_act.py).
            normed = norm_for(layers[0].input_layernorm, h, layers[0].attn_input())
            ctx = replace(ctx, unsummed_outputs=True)  # each output meets a fused add + norm
            for i, layer in enumerate(layers):
                h, out = layer.forward_parts(h, normed, cos, sin, ctx)
                last = i + 1 == len(layers)
                nxt = self.model.norm if last else layers[i + 1].input_layernorm
                h, normed = add_norm_for(h, out, nxt, None if last else layers[i + 1].attn_input())
            return normed
        for layer in layers:
            h = layer(h, cos, sin, ctx)
        return self.model.norm(h)

    def fuse_projections(self) -> None:
        """Engine only: q/k/v_proj into one `qkv_proj` and gate/up_proj into one `gate_up_proj`
        per layer, so a step runs 2 GEMMs where it ran 5 (decode is bound by per-GEMM cost).

        The Hugging Face names keep addressing their rows of the fused weights through
        `weight_view`, so loading, every weight-update path and checksums write and read the
        right slices. The trainer keeps the unfused modules (its parameter names are HF names).
        """
        if self._fused:
            return
        for i in range(self.num_layers):
            self.fuse_layer(i)

    def fuse_layer(self, i: int) -> None:
        """`fuse_projections` for decoder layer i alone: a quantized engine start fuses and
        quantizes each layer as it loads (lowprec/engine_load.py)."""
        self.hf_weight_names()  # the HF names are fixed before the modules change
        layer = self.model.layers[i]
        self._fuse(f"model.layers.{i}.self_attn", layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        if isinstance(layer.mlp, GatedMLP):
            self._fuse(f"model.layers.{i}.mlp", layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj")

    def _fuse(self, prefix: str, module: nn.Module, parts: tuple[str, ...], fused_name: str) -> None:
        linears = [getattr(module, p) for p in parts]
        setattr(module, fused_name, fuse_linears(linears))
        for kind in ("weight", "bias"):
            if getattr(linears[0], kind) is None:
                continue
            fused_param, start = f"{prefix}.{fused_name}.{kind}", 0
            for part, linear in zip(parts, linears):
                end = start + getattr(linear, kind).shape[0]
                self._fused[f"{prefix}.{part}.{kind}"] = (fused_param, start, end)
                self._fused_parts.setdefault(fused_param, []).append((f"{prefix}.{part}.{kind}", start, end))
                start = end
        for part in parts:
            delattr(module, part)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] fp32."""
        return self.lm_head(hidden).float()

    # --- weights by Hugging Face name -------------------------------------------------------------

    def hf_weight_names(self) -> list[str]:
        if self._hf_names is None:
            # named_parameters drops the tied lm_head (same Parameter as embed_tokens): listed once.
            self._hf_names = self._expand_hf_names([name for name, _ in self.named_parameters()])
            self._hf_name_set = frozenset(self._hf_names)
        return list(self._hf_names)

    def _expand_hf_names(self, param_names: list[str]) -> list[str]:
        """Map internal parameter names to checkpoint names (identity for dense models)."""
        return param_names

    def hf_tensors(self, param_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The inverse of `weight_view` for one parameter: the Hugging Face tensors it holds.

        `full` is the complete value of parameter `param_name` (e.g. gathered from FSDP shards);
        the result is the (hf_name, view of `full`) pairs that a checkpoint stores for it. Over
        `named_parameters()` this yields every name of `hf_weight_names()` exactly once.
        """
        if param_name in self._fused_parts:
            return [(name, full[a:b]) for name, a, b in self._fused_parts[param_name]]
        return [(param_name, full)]

    def weight_view(self, hf_name: str) -> torch.Tensor:
        if hf_name == "lm_head.weight" and self.tie_word_embeddings:
            hf_name = "model.embed_tokens.weight"
        if self._hf_names is None:
            self.hf_weight_names()
        if hf_name not in self._hf_name_set:
            raise self.unknown_weight(hf_name)
        if hf_name in self._fused:
            fused_param, start, end = self._fused[hf_name]
            return self.get_parameter(fused_param).detach()[start:end]
        return self.get_parameter(hf_name).detach()  # detached view: copy_ works outside no_grad

    def unknown_weight(self, hf_name: str) -> KeyError:
        close = difflib.get_close_matches(hf_name, self.hf_weight_names(), n=3)
        example = "'model.layers.0.self_attn.q_proj.weight'"
        hint = f"closest names: {close}" if close else f"names look like {example}"
        return KeyError(
            f"{hf_name!r} is not a weight of {type(self).__name__} "
            f"({self.num_layers} layers, vocab {self.vocab_size}); {hint}"
        )


class LlamaForCausalLM(DecoderLM):
    """LlamaForCausalLM: attention_bias / mlp_bias and tied embeddings per config, RoPE default|llama3."""
