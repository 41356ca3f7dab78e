"""Attach trainable LoRA adapters to a native decoder (milepost/models/) and freeze its base.

Each targeted `nn.Linear` becomes a `LoraLinear` that keeps the same `weight`/`bias` Parameters
(so the base keeps its Hugging Face names) and adds `lora_A` [r, in] and `lora_B` [out, r] in fp32,
named as PEFT names them: `model.layers.0.self_attn.q_proj.lora_A.weight`. Initialization follows
PEFT's default (A Kaiming-uniform, B zero), so a fresh adapter leaves the model's outputs unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from milepost.lora.settings import ATTENTION_MODULES, LoraSettings


class LoraLinear(nn.Linear):
    """y = x W^T + b + (x A^T) B^T * scaling, with W and b frozen and A, B trained."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float) -> None:
        with torch.device("meta"):  # W and b are the base's own Parameters, set below
            super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight = base.weight
        self.bias = base.bias
        self.scaling = scaling
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x)) * self.scaling


def is_adapter_name(name: str) -> bool:
    """True for parameter names of adapter matrices (`...q_proj.lora_A.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def _parent(layer: nn.Module, module: str) -> nn.Module:
    return layer.self_attn if module in ATTENTION_MODULES else layer.mlp


def attach_lora(lm: nn.Module, settings: LoraSettings) -> list[str]:
    """Wrap every targeted projection of every decoder layer; returns the wrapped module names.

    Refuses (ValueError naming the layer and module) models whose layers lack a targeted plain
    projection: mixture-of-experts MLPs, MLA attention, models run through transformers.
    """
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if layers is None or not getattr(lm, "native", False):
        raise ValueError(f"LoRA needs a native decoder model (milepost/models/), got {type(lm).__name__}: "
                         "this architecture is not supported with --lora-rank yet")
    wrapped = []
    for i, layer in enumerate(layers):
        for module in settings.target_modules:
            parent = _parent(layer, module)
            base = getattr(parent, module, None)
            if type(base) is not nn.Linear:
                kind = type(parent).__name__
                hint = ("LoRA on mixture-of-experts layers is not supported yet: target attention only "
                        f"(--lora-target-modules {','.join(ATTENTION_MODULES)})"
                        if module not in ATTENTION_MODULES else "this attention has no such projection")
                raise ValueError(f"--lora-target-modules {module}: layer {i} ({kind} of {type(lm).__name__}) "
                                 f"has no plain linear '{module}'; {hint}")
            if getattr(parent, "qkv_proj", None) is not None or getattr(parent, "gate_up_proj", None) is not None:
                raise ValueError("attach_lora: the model's projections are fused (engine layout); "
                                 "attach adapters to the trainer's unfused model")
            setattr(parent, module, LoraLinear(base, settings.rank, settings.scaling))
            wrapped.append(f"model.layers.{i}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}")
    return wrapped


def freeze_base(module: nn.Module) -> None:
    """Only adapter matrices train: the base gets no gradients and no optimizer state."""
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter_name(name))


def adapter_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter matrix, in module order."""
    return ((n, p) for n, p in module.named_parameters() if is_adapter_name(n))
