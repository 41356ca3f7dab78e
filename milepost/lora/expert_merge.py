"""The engine's side of LoRA on mixture-of-experts experts: merged into the expert weights on arrival.

Serving expert adapters unmerged would need per-token grouped LoRA GEMMs inside the grouped expert
kernels; instead the engine keeps one copy of each targeted stacked expert weight as loaded (the
base) and, whenever the adapter's tensors change (load, weight update), rewrites the live weight
as base + s * B_e A_e (`expert_delta`, the trainer's own computation). That is exact for one
adapter, so an engine serving expert targets holds one adapter (`--max-loras-per-batch 1`) and,
while it is merged, serves only requests that name it. Costs one extra copy of the targeted
expert weights in device memory. The base's Hugging Face names of those weights address the base
copy (`base_view`), so a base weight update lands there and reaches the live weights with the
delta re-added, and checksums read the base.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from milepost.lora.experts import EXPERT_PARAMS, expert_delta, expert_targets
from milepost.models.qwen3_moe import SparseMoeBlock, StackedExperts

# The hub's per-expert names and transformers 5's stacked ones (milepost/models/qwen3_moe.py)
_EXPERT_WEIGHT = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(?:\d+\.(gate|up|down)_proj\.weight|(gate_up_proj|down_proj))")


class MergedExperts:
    """Adapter storage (A [E, max_rank, in], B [E, out, max_rank]) and base copies of the targeted
    stacked expert weights of every MoE layer of `layers`; empty when no target is an expert's."""

    def __init__(self, layers: nn.ModuleList, target_modules: tuple[str, ...], max_rank: int,
                 max_loras: int, device: torch.device, dtype: torch.dtype) -> None:
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        self.base: dict[str, torch.Tensor] = {}
        self.live: dict[str, torch.Tensor] = {}
        self.owner: str | None = None  # the adapter whose deltas are merged now
        self.scaling = 0.0
        moe = [(i, layer.mlp) for i, layer in enumerate(layers) if getattr(layer.mlp, "experts", None) is not None]
        targets = expert_targets(target_modules) if moe else ()
        if not targets:
            return
        if max_loras != 1:
            raise ValueError(f"--lora-target-modules {','.join(target_modules)} adapts mixture-of-experts experts, "
                             "whose deltas the engine merges into its expert weights: one adapter at a time; "
                             f"start it with --max-loras-per-batch 1 (got {max_loras}), or target attention only")
        for i, block in moe:
            if type(block) is not SparseMoeBlock or type(block.experts) is not StackedExperts:
                raise ValueError(f"--lora-target-modules: layer {i} ({type(block).__name__}) is a mixture-of-"
                                 "experts block LoRA does not adapt (Qwen3-MoE's only); target attention only")
            for name in targets:
                key = f"model.layers.{i}.mlp.experts.{name}"
                w = getattr(block.experts, EXPERT_PARAMS[name])  # [E, out, in]
                if not w.is_contiguous():
                    raise ValueError(f"layer {i}: stacked expert weight {EXPERT_PARAMS[name]} is not contiguous")
                e, out, d_in = w.shape
                self.live[key] = w.detach()
                self.base[key] = w.detach().clone()
                self.A[key] = torch.zeros(e, max_rank, d_in, device=device, dtype=dtype)
                self.B[key] = torch.zeros(e, out, max_rank, device=device, dtype=dtype)

    def expected(self, target_modules: tuple[str, ...]) -> list[str]:
        """Keys (`model.layers.N.mlp.experts.gate_up_proj`) an adapter on `target_modules` carries."""
        names = expert_targets(target_modules) if self.A else ()
        return [k for k in self.A if k.rsplit(".", 1)[1] in names]

    def shapes(self, key: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        e, _, d_in = self.A[key].shape
        return (e, rank, d_in), (e, self.B[key].shape[1], rank)

    @torch.no_grad()
    def write(self, name: str, scaling: float, rank: int, staged: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Adapter `name`'s expert tensors (key, A [E, r, in], B [E, out, r]) replace any, then merge."""
        for key in self.A:
            self.A[key].zero_()
            self.B[key].zero_()
        for key, a, b in staged:
            self.A[key][:, :rank].copy_(a)
            self.B[key][:, :, :rank].copy_(b)
        self.owner, self.scaling = (name, scaling) if staged else (None, 0.0)
        self.refresh()

    def view(self, key: str, which: str, rank: int) -> torch.Tensor:
        """The live [E, r, in] / [E, out, r] block a weight update writes (then `refresh`)."""
        return self.A[key][:, :rank] if which == "A" else self.B[key][:, :, :rank]

    def base_view(self, name: str, view: torch.Tensor) -> torch.Tensor:
        """The view of base weight `name` (HF name) into a live expert weight -> the same view of
        its base copy; other views as given."""
        m = _EXPERT_WEIGHT.fullmatch(name)
        if m is None or not self.live:
            return view
        which = m.group(2) or m.group(3)
        key = f"{m.group(1)}.{'down_proj' if which in ('down', 'down_proj') else 'gate_up_proj'}"
        if key not in self.live:
            return view
        live, base = self.live[key], self.base[key]  # same shape, both contiguous
        return base.as_strided(view.shape, view.stride(),
                               view.storage_offset() - live.storage_offset() + base.storage_offset())

    def tensors(self) -> list[torch.Tensor]:
        """What this holds on the device (freed with the weights by /release_memory_occupation)."""
        return [*self.base.values(), *self.A.values(), *self.B.values()]

    @torch.no_grad()
    def refresh(self) -> None:
        """Live expert weights = base + the owner's delta (base alone when no adapter is merged)."""
        for key, live in self.live.items():
            if self.owner is None:
                live.copy_(self.base[key])
            else:
                live.copy_(self.base[key] + expert_delta(self.A[key], self.B[key], self.scaling).to(live.dtype))

    def unload(self, name: str) -> None:
        if self.owner == name:
            self.write(name, 0.0, 0, [])

    def refusal(self, lora_name: str | None) -> str | None:
        """Why a request for `lora_name` cannot run now (another adapter's experts are merged)."""
        if self.owner is None or lora_name == self.owner:
            return None
        return (f"this engine merged LoRA adapter {self.owner!r}'s expert deltas into its expert weights "
                f"(--lora-target-modules on mixture-of-experts experts), so it serves only requests with "
                f"lora_path {self.owner!r} until that adapter is unloaded")
