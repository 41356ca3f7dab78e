"""gpt-oss decoder: attention with per-head sinks, sliding/full layers, and a MoE of clamped
SwiGLU experts with biases, on the shared skeleton (`DecoderLM`).

Parameter names are transformers' in-memory names (experts stored as [E, H, 2I] with gate and up
interleaved in the last dim, [E, I, H] for down), so a checkpoint's names address the model
directly. Sink layers attend through masked_attention.py (torch ops). The released checkpoints
store experts in MXFP4 (`*_blocks` / `*_scales`): not implemented, they fail to load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from milepost.models.base import ForwardContext
from milepost.models.llama import DecoderLM
from milepost.models.qwen3 import window_from_layer_types
from milepost.models.qwen3_moe import SparseMoeBlock


class OssRMSNorm(nn.Module):
    """(weight * normalized) in fp32, then the cast: the order transformers' gpt-oss uses."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class OssExperts(nn.Module):
    """E experts: out = (clamp(up) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)."""

    def __init__(self, config: object) -> None:
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H], ids/weights: [T, k] -> [T, H]; one pass per expert that has tokens."""
        outs, tokens = [], []
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            gu = x.index_select(0, tok) @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate, up = gu[..., ::2].clamp(max=self.limit), gu[..., 1::2].clamp(-self.limit, self.limit)
            y = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[e] + self.down_proj_bias[e]
            outs.append(y * weights[tok, slot, None])
            tokens.append(tok)
        return x.new_zeros(x.shape).index_add(0, torch.cat(tokens), torch.cat(outs).to(x.dtype))


class OssMoeBlock(SparseMoeBlock):
    """Router (linear with bias): top-k logits, softmax over those k. Records / replays expert ids."""

    def __init__(self, config: object, layer_id: int) -> None:
        nn.Module.__init__(self)
        self.layer_id = layer_id
        self.top_k: int = config.num_experts_per_tok
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = OssExperts(config)

    @property
    def gate(self) -> nn.Module:
        """What routing probes rank experts by (softmax of the router's logits keeps the order)."""
        return self.router

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        logits = self.router(x)  # [T, E]
        forced = ctx.forced_experts if ctx is not None else None
        if forced is not None:
            ids = forced[:, self.layer_id, :].to(torch.int64)
            top = logits.gather(1, ids)
        else:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
        w = F.softmax(top, dim=1, dtype=top.dtype)
        if ctx is not None and ctx.routed_experts is not None:
            ctx.routed_experts[:, self.layer_id, :] = ids.to(ctx.routed_experts.dtype)
        return self.experts(x, ids, w)


class GptOssForCausalLM(DecoderLM):
    """GptOssForCausalLM: biased q/k/v/o, sinks in every layer, MoE in every layer."""

    def __init__(self, config: object) -> None:
        super().__init__(config)
        eps = config.rms_norm_eps
        for layer in self.model.layers:
            layer.self_attn.sinks = nn.Parameter(torch.empty(config.num_attention_heads))
            layer.input_layernorm = OssRMSNorm(config.hidden_size, eps)
            layer.post_attention_layernorm = OssRMSNorm(config.hidden_size, eps)
        self.model.norm = OssRMSNorm(config.hidden_size, eps)
        self.moe_top_k = config.num_experts_per_tok
        self.num_experts: int = config.num_local_experts
        self.uses_variant_attention = True  # sinks: every layer attends through masked_attention.py

    def check_activation(self, config: object) -> None:
        """The experts' clamped SwiGLU is fixed by the architecture (swiglu_alpha / swiglu_limit)."""

    def layer_window(self, config: object, layer_id: int) -> int | None:
        return window_from_layer_types(config, layer_id)

    def make_mlp(self, config: object, layer_id: int) -> nn.Module:
        return OssMoeBlock(config, layer_id)
