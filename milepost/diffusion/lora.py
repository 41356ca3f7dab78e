"""LoRA for the tiny DiT: adapters on each block's linears, sent to the engine and merged there.

A `LoraLinear` keeps the base `weight`/`bias` Parameters (names unchanged) and adds `lora_A`
[r, in] and `lora_B` [out, r] (B starts at zero, so a fresh adapter changes nothing). The trainer
sends `<module>.lora_A.weight` and `<module>.lora_B.weight` (B already times alpha / r); the engine
sets weight = base + B @ A with `merge`, the same function the trainer uses to check it (report 5.1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

TARGETS = ("qkv", "proj", "mlp.0", "mlp.2")


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype)) * self.scale


def attach_lora(model: nn.Module, rank: int, alpha: float) -> list[str]:
    """Freeze `model` and put adapters on every block linear named in TARGETS (or the model's own
    `lora_targets()`); their module names."""
    for p in model.parameters():
        p.requires_grad_(False)
    if hasattr(model, "lora_targets"):  # a diffusers transformer names its own (milepost/diffusion/hf.py)
        names = model.lora_targets()  # type: ignore[operator]
    else:
        names = [n for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and n.startswith("blocks.") and n.split(".", 2)[2] in TARGETS]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoraLinear(getattr(parent, child), rank, alpha))
    return names


def adapter_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """[(`<module>.lora_A.weight`, A), (`<module>.lora_B.weight`, B * scale)] of every adapter."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear):
            out.append((f"{name}.lora_A.weight", m.lora_A.detach().float()))
            out.append((f"{name}.lora_B.weight", (m.lora_B.detach() * m.scale).float()))
    return out


def merge(base: torch.Tensor, a: torch.Tensor, b_scaled: torch.Tensor) -> torch.Tensor:
    """base + B @ A: the merged weight (engine and trainer compute it with this one function)."""
    return base + b_scaled.to(base.dtype) @ a.to(base.dtype)


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The engine's state after merging `model`'s adapters: base names, merged weights."""
    state = {}
    for name, t in model.state_dict().items():
        if ".lora_" not in name:
            state[name] = t.detach().float()
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear):
            state[f"{name}.weight"] = merge(m.weight.detach().float(), m.lora_A.detach().float(),
                                            (m.lora_B.detach() * m.scale).float())
    return state
