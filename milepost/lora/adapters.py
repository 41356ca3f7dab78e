"""Attach trainable LoRA adapters to a native decoder (milepost/models/) and freeze its base.

Each targeted `nn.Linear` becomes a `LoraLinear` that keeps the same `weight`/`bias` Parameters
(so the base keeps its Hugging Face names) and adds `lora_A` [r, in] and `lora_B` [out, r] in fp32,
named as PEFT names them: `model.layers.0.self_attn.q_proj.lora_A.weight`. Initialization follows
PEFT's default (A Kaiming-uniform, B zero), so a fresh adapter leaves the model's outputs unchanged.
Mixture-of-experts experts get per-expert A/B on their stacked weights (milepost/lora/experts.py).
Multi-LoRA: several named adapters per projection (PEFT's in-memory names,
`...q_proj.lora_A.<adapter>.weight`); each token goes through the adapter its sample names.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from milepost.lora.experts import attach_expert_lora
from milepost.lora.settings import ATTENTION_MODULES, LoraSettings


class AdapterRouting:
    """Which adapter each token of the next forward uses (multi-LoRA); shared by every projection."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.token_adapter: torch.Tensor | None = None  # [tokens] int64, an index into names

    def set(self, token_adapter: torch.Tensor) -> None:
        self.token_adapter = token_adapter

    def masks(self, x: torch.Tensor) -> list[torch.Tensor]:
        """One [tokens, 1] 0/1 mask per adapter, in the dtype of x."""
        index = self.token_adapter
        if index is None or index.numel() != x.shape[-2]:
            raise RuntimeError(f"multi-LoRA forward of {x.shape[-2]} tokens without their adapters "
                               "(set_token_adapters before the forward)")
        return [(index == k).unsqueeze(-1).to(x.dtype) for k in range(len(self.names))]


class LoraLinear(nn.Linear):
    """y = x W^T + b + (x A^T) B^T * scaling, with W and b frozen and A, B trained.

    With `routing` (multi-LoRA), lora_A / lora_B hold one matrix per adapter name and each token
    gets only its adapter's term; every adapter takes part in every forward (the others times
    exact zeros), so all ranks reduce the same gradients whatever their samples.
    """

    def __init__(self, base: nn.Linear, rank: int, scaling: float, routing: AdapterRouting | None = None) -> None:
        with torch.device("meta"):  # W and b are the base's own Parameters, set below
            super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight = base.weight
        self.bias = base.bias
        self.scaling = scaling
        self.routing = routing
        device = base.weight.device

        def pair() -> tuple[nn.Linear, nn.Linear]:
            a = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=torch.float32)
            b = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)
            nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
            nn.init.zeros_(b.weight)
            return a, b

        if routing is None:
            self.lora_A, self.lora_B = pair()
        else:
            pairs = {name: pair() for name in routing.names}
            self.lora_A = nn.ModuleDict({n: a for n, (a, _) in pairs.items()})
            self.lora_B = nn.ModuleDict({n: b for n, (_, b) in pairs.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.routing is None:
            return y + self.lora_B(self.lora_A(x)) * self.scaling
        for name, mask in zip(self.routing.names, self.routing.masks(x)):
            y = y + self.lora_B[name](self.lora_A[name](x)) * (mask * self.scaling)
        return y


def is_adapter_name(name: str) -> bool:
    """True for parameter names of adapter matrices (`...q_proj.lora_A.weight`)."""
    return ".lora_A." in name or ".lora_B." in name


def _parent(layer: nn.Module, module: str) -> nn.Module:
    return layer.self_attn if module in ATTENTION_MODULES else layer.mlp


def attach_lora(lm: nn.Module, settings: LoraSettings) -> list[str]:
    """Wrap every targeted projection of every decoder layer; returns the wrapped module names.

    `settings.adapters` names several adapters (multi-LoRA; `lm.lora_routing` then says which
    adapter each token uses); empty: one unnamed adapter.

    On a mixture-of-experts layer the MLP targets adapt the stacked experts (milepost/lora/experts.py:
    gate_proj + up_proj -> `experts.gate_up_proj`, down_proj -> `experts.down_proj`).
    Refuses (ValueError naming the layer and module) models whose layers lack a targeted plain
    projection (MLA attention, experts of another kind, models run through transformers), and
    multi-LoRA on experts.
    """
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if layers is None or not getattr(lm, "native", False):
        raise ValueError(f"LoRA needs a native decoder model (milepost/models/), got {type(lm).__name__}: "
                         "this architecture is not supported with --lora-rank yet")
    wrapped = []
    routing = AdapterRouting(settings.adapters) if settings.adapters else None
    lm.lora_routing = routing
    moe = [i for i, layer in enumerate(layers) if getattr(layer.mlp, "experts", None) is not None]
    for i, layer in enumerate(layers):
        experts = getattr(layer.mlp, "experts", None)
        if moe and experts is None and any(m not in ATTENTION_MODULES for m in settings.target_modules):
            raise ValueError(f"--lora-target-modules {','.join(settings.target_modules)}: layer {i} of "
                             f"{type(lm).__name__} is a dense MLP beside mixture-of-experts layers {moe}; peft "
                             "maps gate_proj/up_proj/down_proj onto the experts only, so its adapters could not "
                             "be exported: target attention only, or train a model without dense layers")
        if experts is not None:  # a mixture-of-experts layer: its MLP targets are the experts'
            where = f"layer {i} ({type(layer.mlp).__name__} of {type(lm).__name__})"
            adapted = attach_expert_lora(layer.mlp, where, settings.rank, settings.scaling,
                                         settings.target_modules)
            if adapted is not None and routing is not None:
                raise ValueError(f"[[lora.adapters]] with --lora-target-modules on mixture-of-experts experts "
                                 f"({where}): multi-LoRA adapts attention and dense MLPs only; target "
                                 f"attention only (--lora-target-modules {','.join(ATTENTION_MODULES)})")
            if adapted is not None:
                layer.mlp.experts = adapted
                wrapped += [f"model.layers.{i}.mlp.experts.{t}" for t in adapted.targets]
        for module in settings.target_modules:
            if experts is not None and module not in ATTENTION_MODULES:
                continue
            parent = _parent(layer, module)
            base = getattr(parent, module, None)
            if type(base) is not nn.Linear:
                kind = type(parent).__name__
                hint = ("this MLP is neither a plain gated MLP nor native stacked experts"
                        if module not in ATTENTION_MODULES else "this attention has no such projection")
                raise ValueError(f"--lora-target-modules {module}: layer {i} ({kind} of {type(lm).__name__}) "
                                 f"has no plain linear '{module}'; {hint}")
            if getattr(parent, "qkv_proj", None) is not None or getattr(parent, "gate_up_proj", None) is not None:
                raise ValueError("attach_lora: the model's projections are fused (engine layout); "
                                 "attach adapters to the trainer's unfused model")
            setattr(parent, module, LoraLinear(base, settings.rank, settings.scaling, routing))
            wrapped.append(f"model.layers.{i}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}")
    return wrapped


def freeze_base(module: nn.Module) -> None:
    """Only adapter matrices train: the base gets no gradients and no optimizer state."""
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter_name(name))


def store_frozen_in(module: nn.Module, dtype: torch.dtype) -> int:
    """Store every parameter that does not train (the base under an adapter, or a whole frozen
    model) in `dtype`; adapter matrices keep their fp32 masters. Returns the bytes this saved.

    For a bf16 run this changes no result: FSDP2's mixed precision casts each parameter to bf16
    when it gathers it, and a bf16-stored one is already those values. Parameters are converted
    in place (`.data`), so tied ones (embeddings / LM head) stay tied; buffers (RoPE) keep theirs."""
    saved = 0
    with torch.no_grad():
        for name, p in module.named_parameters():
            if is_adapter_name(name) or p.dtype == dtype or not p.dtype.is_floating_point:
                continue
            before = p.numel() * p.element_size()
            p.data = p.data.to(dtype)
            saved += before - p.numel() * p.element_size()
    return saved


def adapter_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter matrix, in module order."""
    return ((n, p) for n, p in module.named_parameters() if is_adapter_name(n))


def set_token_adapters(lm: nn.Module, samples_adapter: list[int], lengths: list[int], device: torch.device) -> None:
    """Multi-LoRA: the next forward packs samples of `lengths` tokens, sample i using adapter
    `samples_adapter[i]` (an index into the adapter names)."""
    index = torch.repeat_interleave(torch.tensor(samples_adapter, dtype=torch.int64),
                                    torch.tensor(lengths, dtype=torch.int64))
    lm.lora_routing.set(index.to(device))


def adapter_of_param(name: str) -> tuple[str | None, str]:
    """('add', 'model...q_proj.lora_A.weight') of 'model...q_proj.lora_A.add.weight'; (None, name) of
    a single adapter's parameter name."""
    head, which, tail = name.rpartition(".lora_A.") if ".lora_A." in name else name.rpartition(".lora_B.")
    parts = tail.split(".")
    if len(parts) == 2:  # '<adapter>.weight'
        return parts[0], f"{head}{which}{parts[1]}"
    return None, name
