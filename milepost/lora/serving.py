"""Serving LoRA adapters beside one resident base model, without merging (SGLang's multi-LoRA).

`AdapterPool` keeps every loaded adapter in fixed slots of stacked tensors per projection
(A: [slots, max_rank, in], B: [out, slots, max_rank]; a smaller rank is zero-padded, which adds
exact zeros; slot 0 = the base model has no storage). Before each forward the runner gives each
token its adapter's slot; a forward hook on every projection (q/k/v/o, gate/up/down, fused or
not) adds x A^T B^T * scaling for the tokens of each adapter, by one of the two paths of
milepost/lora/kernels.py: `segment` (CPU) or `stacked` (CUDA, capturable in decode CUDA graphs).
Adapters on mixture-of-experts experts are merged into the expert weights instead, one adapter at
a time (milepost/lora/expert_merge.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from milepost.lora.expert_merge import MergedExperts
from milepost.lora.kernels import KERNELS, segment_delta, stacked_deltas
from milepost.lora.peft_format import read_peft_adapter
from milepost.lora.settings import ATTENTION_MODULES, LoraSettings


class AdapterError(ValueError):
    """A request or an adapter the pool cannot take; the message names the adapter and the fix."""


@dataclass
class _Part:
    """One HF projection inside a physical linear: its output rows [start, end)."""

    key: str  # "model.layers.0.self_attn.q_proj"
    start: int
    end: int


@dataclass
class _Loaded:
    slot: int
    settings: LoraSettings
    path: str
    names: list[str] = field(default_factory=list)  # its tensors' names (...q_proj.lora_A.weight)


def _parts(layer: nn.Module, i: int, module: str) -> tuple[nn.Linear, _Part] | None:
    """The physical linear computing HF projection `module` of layer i, and its rows there."""
    attn = module in ATTENTION_MODULES
    parent = layer.self_attn if attn else layer.mlp
    key = f"model.layers.{i}.{'self_attn' if attn else 'mlp'}.{module}"
    plain = getattr(parent, module, None)
    if isinstance(plain, nn.Linear):
        return plain, _Part(key, 0, plain.out_features)
    fused_name, members = (("qkv_proj", ("q_proj", "k_proj", "v_proj")) if attn
                           else ("gate_up_proj", ("gate_proj", "up_proj")))
    fused = getattr(parent, fused_name, None)
    if module not in members or not isinstance(fused, nn.Linear):
        return None
    sizes = parent._qkv_sizes if attn else [fused.out_features // 2] * 2
    start = sum(sizes[: members.index(module)])
    return fused, _Part(key, start, start + sizes[members.index(module)])


class AdapterPool:
    """Adapters resident in one engine: load / unload by name, per-token application in forwards.

    Not thread-safe: the engine calls everything from its own thread, between steps.
    """

    def __init__(self, model: nn.Module, target_modules: Sequence[str], max_rank: int,
                 max_loras: int, device: torch.device, dtype: torch.dtype, kernel: str | None = None) -> None:
        if max_rank <= 0 or max_loras <= 0:
            raise ValueError(f"--max-lora-rank ({max_rank}) and --max-loras-per-batch ({max_loras}) must be > 0")
        self.max_rank, self.max_loras = max_rank, max_loras
        self.target_modules = tuple(target_modules)
        self.loaded: dict[str, _Loaded] = {}
        self.A: dict[str, torch.Tensor] = {}
        self.B: dict[str, torch.Tensor] = {}
        self.scaling = torch.zeros(max_loras + 1, dtype=torch.float32)  # [slot]; slot 0 = the base
        # The reference path on CPU; on CUDA the stacked one (no host syncs, CUDA-graph safe).
        self.kernel = kernel or ("stacked" if device.type == "cuda" else "segment")
        if self.kernel not in KERNELS:
            raise ValueError(f"LoRA kernel {self.kernel!r}: choose one of {list(KERNELS)}")
        self.device, self.dtype = device, dtype
        self._segments: list[tuple[int, torch.Tensor, float]] = []  # segment: (index, token rows, scaling)
        self._weights: torch.Tensor | None = None  # stacked: [tokens, slots] scaling of each token's slot
        self._graph_weights: torch.Tensor | None = None  # stacked, decode graphs: [max graph bs, slots]
        self._hooks = []
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or not getattr(model, "native", False):
            raise ValueError(f"--enable-lora needs a native model (milepost/models/), not {type(model).__name__}")
        # MoE experts: merged on arrival (one adapter); refuses other MoE blocks / several slots.
        self.experts = MergedExperts(layers, self.target_modules, max_rank, max_loras, device, dtype)
        by_module: dict[int, tuple[nn.Linear, list[_Part]]] = {}
        for i, layer in enumerate(layers):
            for module in self.target_modules:
                if module not in ATTENTION_MODULES and getattr(layer.mlp, "experts", None) is not None:
                    continue  # the experts' adapters: self.experts
                found = _parts(layer, i, module)
                if found is None:
                    raise ValueError(f"--lora-target-modules {module}: layer {i} of {type(model).__name__} "
                                     "has no such plain projection; target the projections it has")
                linear, part = found
                by_module.setdefault(id(linear), (linear, []))[1].append(part)
        for linear, parts in by_module.values():
            # The A of the projections fused in one linear (q/k/v, gate/up) share a tensor, so the
            # stacked path projects x into all of them with one matmul; each part's A is a view.
            a = torch.zeros(len(parts), max_loras, max_rank, linear.in_features, device=device, dtype=dtype)
            for j, part in enumerate(parts):
                self.A[part.key] = a[j]
                self.B[part.key] = torch.zeros(part.end - part.start, max_loras, max_rank, device=device, dtype=dtype)
            self._hooks.append(linear.register_forward_hook(self._hook(parts, a)))

    # -- adapters ----------------------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> None:
        """Load the PEFT directory at `path` as adapter `name`; AdapterError leaves the pool as it was."""
        if name in self.loaded:
            raise AdapterError(f"lora_name: adapter {name!r} is already loaded (from {self.loaded[name].path}); "
                               "unload it first or pick another name")
        try:
            settings, tensors = read_peft_adapter(path)
        except (ValueError, OSError) as e:
            raise AdapterError(f"adapter {name!r}: lora_path {e}") from None
        self.load_tensors(name, settings, tensors, str(path))

    def load_tensors(self, name: str, settings: LoraSettings, tensors: dict[str, torch.Tensor],
                     path: str = "<tensors>") -> None:
        if not name:
            raise AdapterError("lora_name: must not be empty")
        free = sorted(set(range(1, self.max_loras + 1)) - {a.slot for a in self.loaded.values()})
        if not free:
            raise AdapterError(f"lora_name {name!r}: all {self.max_loras} adapter slots are in use "
                               f"({sorted(self.loaded)}); unload one or raise --max-loras-per-batch")
        if settings.rank > self.max_rank:
            raise AdapterError(f"adapter {name!r} has rank {settings.rank}, more than --max-lora-rank "
                               f"{self.max_rank}; restart the engine with --max-lora-rank {settings.rank}")
        extra = [m for m in settings.target_modules if m not in self.target_modules]
        if extra:
            raise AdapterError(f"adapter {name!r} targets {extra}, which this engine does not serve "
                               f"(--lora-target-modules {','.join(self.target_modules)})")
        staged, staged_experts = self._stage(name, settings, tensors)
        slot = free[0]
        i = slot - 1
        with torch.no_grad():
            for key in self.A:  # projections it does not target stay exact zeros
                self.A[key][i].zero_()
                self.B[key][:, i].zero_()
            for key, a, b in staged:
                self.A[key][i, : settings.rank].copy_(a)
                self.B[key][:, i, : settings.rank].copy_(b)
        self.scaling[slot] = settings.scaling
        self.experts.write(name, settings.scaling, settings.rank, staged_experts)
        self.loaded[name] = _Loaded(slot, settings, path, sorted(tensors))

    def _stage(self, name: str, settings: LoraSettings, tensors: dict[str, torch.Tensor]
               ) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list[tuple[str, torch.Tensor, torch.Tensor]]]:
        """Check every tensor against the base's shapes before anything is written: (projections,
        experts) as (key, A, B)."""
        problems, staged, staged_experts = [], [], []
        keys = [k for k in self.A if k.rsplit(".", 1)[1] in settings.target_modules]
        expert_keys = self.experts.expected(settings.target_modules)
        expected = {f"{k}.lora_{m}.weight" for k in keys + expert_keys for m in "AB"}
        unknown = sorted(set(tensors) - expected)
        missing = sorted(expected - set(tensors))
        if unknown:
            problems.append(f"tensors {unknown[:3]} name no projection this base has (an adapter for another base?)")
        if missing:
            problems.append(f"tensors {missing[:3]} are missing ({len(missing)} in all)")
        for key in keys:
            a, b = tensors.get(f"{key}.lora_A.weight"), tensors.get(f"{key}.lora_B.weight")
            if a is None or b is None:
                continue
            want_a = (settings.rank, self.A[key].shape[2])
            want_b = (self.B[key].shape[0], settings.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                problems.append(f"{key}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected "
                                f"{list(want_a)} / {list(want_b)} (rank {settings.rank} on this base)")
                continue
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                problems.append(f"{key}: NaN or infinite values")
                continue
            staged.append((key, a, b))
        for key in expert_keys:
            a, b = tensors.get(f"{key}.lora_A.weight"), tensors.get(f"{key}.lora_B.weight")
            want_a, want_b = self.experts.shapes(key, settings.rank)
            if a is None or b is None:
                continue
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                problems.append(f"{key}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, expected "
                                f"{list(want_a)} / {list(want_b)} (experts x rank {settings.rank} on this base)")
            elif not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                problems.append(f"{key}: NaN or infinite values")
            else:
                staged_experts.append((key, a, b))
        if problems:
            raise AdapterError(f"adapter {name!r} does not fit this model: " + "; ".join(problems[:5]))
        return staged, staged_experts

    def unload(self, name: str) -> None:
        entry = self.loaded.pop(name, None)
        if entry is None:
            raise AdapterError(f"lora_name: adapter {name!r} is not loaded; loaded: {sorted(self.loaded)}")
        with torch.no_grad():
            for key in self.A:
                self.A[key][entry.slot - 1].zero_()
                self.B[key][:, entry.slot - 1].zero_()
        self.scaling[entry.slot] = 0.0
        self.experts.unload(name)

    def refusal(self, lora_name: str | None) -> str | None:
        """Why a request for `lora_name` cannot be admitted now (None: it can)."""
        return self.experts.refusal(lora_name)

    def after_weight_commit(self) -> None:
        """After any weight update: live expert weights = their base copy + the merged adapter's
        delta (an update may have written either); a no-op without expert targets."""
        if self.experts.live:
            self.experts.refresh()

    def slot_of(self, name: str | None) -> int:
        """0 for the base model (None), else the adapter's slot; AdapterError for an unknown name."""
        if name is None:
            return 0
        entry = self.loaded.get(name)
        if entry is None:
            raise AdapterError(f"lora_path: adapter {name!r} is not loaded; loaded: {sorted(self.loaded)} "
                               "(load it with POST /load_lora_adapter)")
        return entry.slot

    def paths(self) -> dict[str, str]:
        return {n: a.path for n, a in self.loaded.items()}

    # -- weights by name (weight updates and checksums address adapter tensors) -----------------

    def tensor_names(self) -> Iterator[str]:
        for entry in self.loaded.values():
            yield from entry.names

    def view(self, adapter: str, name: str) -> torch.Tensor:
        """The live [rank, in] / [out, rank] block of adapter tensor `name` (...q_proj.lora_A.weight)."""
        entry = self.loaded[adapter]
        key, which = name.rsplit(".lora_", 1)
        r = entry.settings.rank
        if key in self.experts.A:  # written by weight updates, merged by after_weight_commit
            return self.experts.view(key, which[0], r)
        i = entry.slot - 1
        return self.A[key][i, :r] if which == "A.weight" else self.B[key][:, i, :r]

    # -- forwards ------------------------------------------------------------------------------

    def set_batch(self, chunk_slots: Sequence[int], chunk_lengths: Sequence[int]) -> None:
        """Adapter slot and token count of each chunk of the next (eager) forward, in flat-batch order."""
        self._segments, self._weights = [], None
        if not any(chunk_slots):  # base only: the hooks add nothing
            return
        slots = torch.repeat_interleave(torch.tensor(chunk_slots), torch.tensor(chunk_lengths))
        if self.kernel == "stacked":
            self._weights = self._slot_weights(slots).to(self.device, self.dtype, non_blocking=True)
            return
        self._segments = [(s - 1, (slots == s).nonzero()[:, 0].to(self.device), float(self.scaling[s]))
                          for s in torch.unique(slots).tolist() if s != 0]

    def _slot_weights(self, slots: torch.Tensor) -> torch.Tensor:
        """[tokens, max_loras] fp32: the scaling of each token's slot in its column, zeros elsewhere
        (the forwards read it in the adapters' dtype: no cast per projection)."""
        one_hot = torch.nn.functional.one_hot(slots.long(), self.max_loras + 1).float()
        return (one_hot * self.scaling)[:, 1:]

    # -- decode CUDA graphs (stacked path): the weights live in a static buffer the graphs read --

    def prepare_graphs(self, max_bs: int) -> None:
        if self.kernel != "stacked":
            raise ValueError(f"LoRA kernel {self.kernel!r} cannot run in CUDA graphs; use 'stacked'")
        self._graph_weights = torch.zeros(max_bs, self.max_loras, device=self.device, dtype=self.dtype)

    def capturing(self, bs: int) -> None:
        """The next forward is captured at batch size bs: the hooks read the static buffer."""
        self._segments, self._weights = [], self._graph_weights[:bs]

    def set_graph_batch(self, row_slots: Sequence[int]) -> None:
        """Before a replay: row i of the decode batch uses slot row_slots[i]; padding rows none."""
        w = self._slot_weights(torch.tensor(row_slots, dtype=torch.long))
        self._graph_weights.zero_()
        self._graph_weights[: len(row_slots)].copy_(w, non_blocking=True)

    def _hook(self, parts: list[_Part], a: torch.Tensor):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            x = inputs[0]
            if self._weights is not None:
                deltas = stacked_deltas(x, a, [self.B[p.key] for p in parts], self._weights)
                for p, delta in zip(parts, deltas):
                    out[:, p.start : p.end] += delta.to(out.dtype)
                return out
            for p in parts:
                for rows, delta in segment_delta(x, self.A[p.key], self.B[p.key], self._segments):
                    out[rows, p.start : p.end] += delta.to(out.dtype)
            return out

        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
