"""Qwen3-MoE decoder: Qwen3 attention with sparse top-k expert MLPs (dense MLP on mlp_only_layers).

Experts are stored stacked (`w13` [E, 2I, H] = gate rows then up rows, `w2` [E, H, I]) so a grouped
GEMM can replace the per-expert loop later; `weight_view` maps the hub's per-expert names and
transformers 5's fused names onto slices of them. The context can record the experts used
(`routed_experts`) or force them (`forced_experts`, routing replay) while the router keeps gradients.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from milepost.kernels.grouped_experts import (
    fused_config,
    grouped_available,
    grouped_expert_mlp,
    grouped_train_available,
)
from milepost.models.base import ForwardContext
from milepost.models.layers import GatedMLP, gpu_inference
from milepost.models.qwen3 import Qwen3ForCausalLM

_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_NAME = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


class StackedExperts(nn.Module):
    """E gated-SiLU experts in two stacked parameters: grouped GEMMs on CUDA, a loop over experts on CPU."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.fused_train = False  # set_fused_training: grouped GEMMs with backward in training

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) the forward uses; LoRA on experts (milepost/lora/experts.py) adds its deltas."""
        return self.w13, self.w2

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H], ids: [T, k] int64, weights: [T, k] (x.dtype) -> [T, H]."""
        w13, w2 = self.expert_weights()
        if grouped_available(x):  # GPU inference: no host sync either way (CUDA-graph safe)
            cfg = fused_config(x, ids, w13, w2)  # the fused Triton MoE where measured faster
            if cfg is not None:
                from milepost.kernels.fused_moe import fused_expert_mlp

                return fused_expert_mlp(x, ids, weights, w13, w2, cfg)
            return grouped_expert_mlp(x, ids, weights, w13, w2)
        if self.fused_train and grouped_train_available(x):  # the trainer: the same, differentiable
            from milepost.kernels import train_fused

            return grouped_expert_mlp(x, ids, weights, w13, w2, act=train_fused.silu_mul)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host sync per layer
        if len(counts) > self.num_experts:
            raise ValueError(f"expert ids must lie in [0, {self.num_experts}); check forced_experts")
        flat_w = weights.reshape(-1)
        outs, tokens, start = [], [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            tok = pairs // k
            gate, up = F.linear(x.index_select(0, tok), w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])
            outs.append(y * flat_w.index_select(0, pairs)[:, None])
            tokens.append(tok)
        # One out-of-place scatter-add at the end: autograd-safe and a single pass over [T, H].
        return x.new_zeros(x.shape).index_add(0, torch.cat(tokens), torch.cat(outs))


class SparseMoeBlock(nn.Module):
    """Router (`gate`, fp32 softmax, top-k, optional renormalization) feeding `experts`."""

    # GPU inference (kernels/moe_router.py): "fused" runs softmax, top-k, renormalization, cast and
    # record in one kernel (x1.04 tok/s on the 30B-A3B shape, H100); "finish" only the end after
    # torch's softmax and top-k (the same values as "torch"); "torch" neither. A class switch so
    # benchmarks can measure each.
    router_kernels = "fused"

    def __init__(self, config: object, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.top_k: int = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H]."""
        forced = ctx.forced_experts if ctx is not None else None
        kernels = self.router_kernels if forced is None and gpu_inference(x) else "torch"
        record = ctx.routed_experts[:, self.layer_id, :] if ctx is not None \
            and ctx.routed_experts is not None else None
        if kernels != "torch":
            from milepost.kernels import moe_router  # triton: imported on GPU only
        if kernels == "fused" and self.experts.num_experts <= moe_router.MAX_EXPERTS:
            w, ids = moe_router.route(self.gate(x), self.top_k, self.norm_topk_prob, x.dtype, record)
            return self.experts(x, ids, w)
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E] fp32
        if forced is not None:
            ids = forced[:, self.layer_id, :].to(torch.int64)
            if ids.shape != (x.shape[0], self.top_k):
                raise ValueError(
                    f"forced_experts must be [T={x.shape[0]}, layers, top_k={self.top_k}], "
                    f"got {tuple(forced.shape)}"
                )
            w = probs.gather(1, ids)  # the router's probs at the forced ids: gradients still reach it
        else:
            w, ids = torch.topk(probs, self.top_k, dim=-1)
            if kernels != "torch":
                s = w.sum(dim=-1, keepdim=True) if self.norm_topk_prob else None
                return self.experts(x, ids, moe_router.finish_routing(w, s, ids, x.dtype, record))
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        if record is not None:
            record.copy_(ids.to(record.dtype))
        return self.experts(x, ids, w.to(x.dtype))


def is_moe_layer(config: object, layer_id: int) -> bool:
    """transformers' rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    return (
        layer_id not in mlp_only
        and config.num_experts > 0
        and (layer_id + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3MoeForCausalLM; `moe_top_k` = num_experts_per_tok."""

    def __init__(self, config: object) -> None:
        super().__init__(config)
        self.moe_top_k = config.num_experts_per_tok
        self.num_experts: int = config.num_experts

    def layer_window(self, config: object, layer_id: int) -> int | None:
        # transformers' Qwen3-MoE slides every layer when use_sliding_window (its config then
        # keeps sliding_window, else sets it to None); there are no per-layer types.
        return getattr(config, "sliding_window", None)

    def make_mlp(self, config: object, layer_id: int) -> nn.Module:
        if is_moe_layer(config, layer_id):
            return SparseMoeBlock(config, layer_id)
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def _expand_hf_names(self, param_names: list[str]) -> list[str]:
        names = []
        for name in param_names:
            if name.endswith(".mlp.experts.w13"):
                prefix = name[: -len("w13")]
                for e in range(self.num_experts):
                    names += [f"{prefix}{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            elif not name.endswith(".mlp.experts.w2"):
                names.append(name)
        return names

    def hf_tensors(self, param_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Stacked experts split into the hub's per-expert names (see `weight_view` for the layout)."""
        for stacked in ("w13", "w2"):
            if param_name.endswith(f".mlp.experts.{stacked}"):
                prefix, inter = param_name[: -len(stacked)], self.hf_config.moe_intermediate_size
                if stacked == "w2":
                    return [(f"{prefix}{e}.down_proj.weight", full[e]) for e in range(self.num_experts)]
                out = []
                for e in range(self.num_experts):
                    out.append((f"{prefix}{e}.gate_proj.weight", full[e, :inter]))
                    out.append((f"{prefix}{e}.up_proj.weight", full[e, inter:]))
                return out
        return super().hf_tensors(param_name, full)

    def _experts(self, layer: str, hf_name: str) -> StackedExperts:
        layer_id = int(layer)
        if layer_id >= self.num_layers or not isinstance(self.model.layers[layer_id].mlp, SparseMoeBlock):
            raise self.unknown_weight(hf_name)
        return self.model.layers[layer_id].mlp.experts

    def weight_view(self, hf_name: str) -> torch.Tensor:
        m = _EXPERT_NAME.fullmatch(hf_name)
        if m:
            experts = self._experts(m.group(1), hf_name)
            e, which, inter = int(m.group(2)), m.group(3), experts.intermediate
            if e >= self.num_experts:
                raise self.unknown_weight(hf_name)
            if which == "gate":
                return experts.w13.detach()[e, :inter]
            if which == "up":
                return experts.w13.detach()[e, inter:]
            return experts.w2.detach()[e]
        m = _FUSED_NAME.fullmatch(hf_name)
        if m:  # transformers 5 in-memory layout: gate_up_proj [E, 2I, H] (gate then up), down_proj [E, H, I]
            experts = self._experts(m.group(1), hf_name)
            return (experts.w13 if m.group(2) == "gate_up_proj" else experts.w2).detach()
        return super().weight_view(hf_name)
