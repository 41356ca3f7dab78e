"""LoRA on mixture-of-experts experts (grouped): per-expert A/B beside the stacked expert weights.

The native MoE layer keeps its experts stacked (`w13` [E, 2I, H] = gate rows then up rows, `w2`
[E, H, I]), as transformers 5 and peft see them (`mlp.experts.gate_up_proj` / `down_proj`). So an
expert adapter is peft's `target_parameters` LoRA: one A [E, r, in] and B [E, out, r] per stacked
parameter (gate and up share one, on the fused gate_up rows). The forward adds the merged delta
s * B_e A_e to each expert's weights (one bmm per layer, differentiable in A and B); the engine
merges the same delta into its expert weights when an adapter arrives (milepost/lora/serving.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from milepost.models.qwen3_moe import SparseMoeBlock, StackedExperts

# transformers' / peft's name of a stacked expert parameter -> ours, and the projections it holds
EXPERT_PARAMS = {"gate_up_proj": "w13", "down_proj": "w2"}
EXPERT_MODULES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PEFT_EXPERTS = "mlp.experts."  # peft's target_parameters entries: "mlp.experts.gate_up_proj"


def expert_targets(target_modules: tuple[str, ...]) -> tuple[str, ...]:
    """Stacked expert parameters an adapter on `target_modules` covers ('gate_up_proj', 'down_proj').

    gate and up are one stacked parameter with one adapter, so targeting only one of them is
    refused (ValueError naming the setting)."""
    gate, up = "gate_proj" in target_modules, "up_proj" in target_modules
    if gate != up:
        raise ValueError(f"--lora-target-modules {','.join(target_modules)}: mixture-of-experts experts hold "
                         "gate and up as one stacked parameter (gate_up_proj) with one adapter; target both "
                         "gate_proj and up_proj, or neither")
    return tuple(p for p, mods in EXPERT_MODULES.items() if all(m in target_modules for m in mods))


def expert_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """a: [E, r, in], b: [E, out, r] -> [E, out, in] = scaling * b_e @ a_e (trainer and engine alike)."""
    return torch.bmm(b, a) * scaling


class _Matrix(nn.Module):
    """Holds one `weight` so adapter tensors get PEFT-style names (`...lora_A.weight`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


class ExpertAdapter(nn.Module):
    """lora_A.weight [E, r, in] (each expert's A Kaiming-uniform as nn.Linear's) and lora_B.weight
    [E, out, r] (zeros: a fresh adapter changes nothing)."""

    def __init__(self, experts: int, rank: int, fan_in: int, fan_out: int, device: torch.device) -> None:
        super().__init__()
        a = torch.empty(experts, rank, fan_in, device=device, dtype=torch.float32)
        for e in range(experts):
            nn.init.kaiming_uniform_(a[e], a=math.sqrt(5))
        self.lora_A = _Matrix(a)
        self.lora_B = _Matrix(torch.zeros(experts, fan_out, rank, device=device, dtype=torch.float32))


class LoraStackedExperts(StackedExperts):
    """The base's `w13` / `w2` Parameters (frozen) plus an `ExpertAdapter` named `gate_up_proj` and/or
    `down_proj`; every forward path (CPU loop, grouped GEMMs) uses the merged weights."""

    def __init__(self, base: StackedExperts, rank: int, scaling: float, targets: tuple[str, ...]) -> None:
        with torch.device("meta"):  # w13 / w2 are the base's own Parameters, set below
            super().__init__(base.num_experts, base.w2.shape[1], base.intermediate)
        self.w13, self.w2, self.fused_train = base.w13, base.w2, base.fused_train
        self.scaling = scaling
        self.targets = targets
        device = base.w13.device
        for name in targets:
            w = getattr(self, EXPERT_PARAMS[name])  # [E, out, in]
            setattr(self, name, ExpertAdapter(base.num_experts, rank, w.shape[2], w.shape[1], device))

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for name, ours in EXPERT_PARAMS.items():
            w = getattr(self, ours)
            if name in self.targets:
                adapter = getattr(self, name)
                w = w + expert_delta(adapter.lora_A.weight, adapter.lora_B.weight, self.scaling).to(w.dtype)
            out.append(w)
        return out[0], out[1]


def attach_expert_lora(block: nn.Module, where: str, rank: int, scaling: float,
                       target_modules: tuple[str, ...]) -> LoraStackedExperts | None:
    """The adapted replacement of `block.experts` (a MoE layer's), or None when no target is an
    expert's. ValueError naming `where` for other MoE blocks (shared experts, biases, other
    activations: DeepSeek-V3, gpt-oss), whose MLP parts an adapter would silently miss."""
    targets = expert_targets(target_modules)
    if not targets:
        return None
    if type(block) is not SparseMoeBlock or type(block.experts) is not StackedExperts:
        raise ValueError(f"--lora-target-modules {','.join(target_modules)}: {where} is a mixture-of-experts "
                         "block LoRA does not adapt (experts are adapted on Qwen3-MoE's blocks only); "
                         "target attention only (q_proj,k_proj,v_proj,o_proj)")
    return LoraStackedExperts(block.experts, rank, scaling, targets)


def is_expert_adapter(name: str) -> bool:
    """'model.layers.0.mlp.experts.gate_up_proj.lora_A.weight' and the like."""
    return any(f".mlp.experts.{p}.lora_" in name for p in EXPERT_PARAMS)


def to_peft_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """Ours -> peft's ParamWrapper layout: A [E, r, in] -> [E*r, in] (expert-major rows);
    B [E, out, r] -> [out, r*E] (column j*E + e is expert e's rank j)."""
    if ".lora_A." in name:
        return t.reshape(-1, t.shape[-1])
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)


def from_peft_layout(name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
    """The inverse of `to_peft_layout` (ValueError when the shape does not hold whole experts)."""
    if t.ndim != 2:
        raise ValueError(f"{name}: expected a 2-d peft expert tensor, got shape {list(t.shape)}")
    if ".lora_A." in name:
        if t.shape[0] % rank:
            raise ValueError(f"{name}: {t.shape[0]} rows is not experts x rank {rank}")
        return t.reshape(-1, rank, t.shape[1])
    if t.shape[1] % rank:
        raise ValueError(f"{name}: {t.shape[1]} columns is not rank {rank} x experts")
    return t.reshape(t.shape[0], rank, -1).permute(2, 0, 1).contiguous()
