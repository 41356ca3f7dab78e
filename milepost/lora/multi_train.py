"""The trainer's side of multi-LoRA: several named adapters on one frozen base, one AdamW.

Each adapter is a parameter group with its own lr (the run's schedule scales each); each token of
a packed micro-batch goes through its sample's adapter (`TrainBatch.adapters`). Every adapter
takes part in every forward, so an adapter with no sample in an optimizer step gets exact-zero
gradients; those are dropped before the step (AdamW skips a parameter without a gradient), so its
weights, moments and step count stay as they were, and a weight update sends only the adapters
that stepped since the last one (the first update of a run sends all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from milepost.lora.adapters import (
    adapter_of_param,
    adapter_parameters,
    set_token_adapters,
)
from milepost.lora.peft_format import write_peft_adapter
from milepost.lora.settings import ADAPTER_SEP, LoraSettings


class AdapterSteps:
    """Routing, optimizer groups and the stepped set of a multi-LoRA policy `lm`."""

    def __init__(self, lm: nn.Module, adapters: Sequence[tuple[str, float]], base_lr: float) -> None:
        self.lm = lm
        self.names = [name for name, _ in adapters]
        self.lrs = dict(adapters)
        self.base_lr = base_lr
        self.index = {name: i for i, name in enumerate(self.names)}
        # Stepped since the engines last got them; at start all (after a resume the engines may
        # hold older adapters, and an update must carry at least one tensor).
        self.pending: set[str] = set(self.names)

    def params_of(self, adapter: str) -> list[nn.Parameter]:
        return [p for n, p in adapter_parameters(self.lm) if adapter_of_param(n)[0] == adapter]

    def param_groups(self) -> list[dict]:
        """AdamW groups: one per adapter; `lr_scale` = its lr / the run's lr (the schedule's base)."""
        base = self.base_lr if self.base_lr > 0 else 1.0
        return [{"params": self.params_of(n), "lr_scale": self.lrs[n] / base, "adapter": n} for n in self.names]

    def route(self, adapters: Sequence[str] | None, mb: Sequence[int], lengths: Sequence[int],
              n_tokens: int, device: torch.device) -> None:
        """Before a policy forward over samples `mb` (packed in that order, `lengths` tokens each;
        `n_tokens` in all: an empty `mb` is a placeholder forward, routed to the first adapter)."""
        if not mb:
            set_token_adapters(self.lm, [0], [n_tokens], device)
            return
        if adapters is None:
            raise ValueError(f"multi-LoRA ({self.names}): every sample needs its adapter "
                             "(Sample.metadata['lora_adapter']); the rollout did not name one")
        unknown = sorted({adapters[i] for i in mb} - set(self.index))
        if unknown:
            raise ValueError(f"samples name LoRA adapters {unknown}, not among the trained ones {self.names}")
        set_token_adapters(self.lm, [self.index[adapters[i]] for i in mb], list(lengths), device)

    def before_step(self, adapters: Sequence[str], step: Sequence[int],
                    all_reduce: Callable[[list[float]], list[float]]) -> list[str]:
        """Collective. Drop the gradients of adapters with no sample in this optimizer step on any
        rank; returns the adapters that step."""
        mine = [0.0] * len(self.names)
        for i in step:
            mine[self.index[adapters[i]]] += 1
        counts = all_reduce(mine)
        stepped = [n for n, c in zip(self.names, counts) if c > 0]
        for name, c in zip(self.names, counts):
            if c == 0:
                for p in self.params_of(name):
                    p.grad = None
        self.pending.update(stepped)
        return stepped

    def take_pending(self) -> set[str]:
        """The adapters to send now (stepped since the last send); the set starts again empty."""
        out, self.pending = self.pending, set()
        return out

    def engine_params(self, only: set[str]) -> Iterator[tuple[str, nn.Parameter]]:
        """("<adapter>/<PEFT tensor name>", parameter) of the adapters in `only`, in module order."""
        for n, p in adapter_parameters(self.lm):
            adapter, name = adapter_of_param(n)
            if adapter in only:
                yield f"{adapter}{ADAPTER_SEP}{name}", p

    def export(self, path: str | Path, settings: LoraSettings, base_model: str | Path, lead: bool) -> None:
        """Collective: PATH/<adapter>, one PEFT adapter directory per adapter (written by `lead`)."""
        for adapter in self.names:
            named = []
            with torch.no_grad():  # fp32 masters, gathered on every rank in the same order
                for full_name, p in adapter_parameters(self.lm):
                    owner, name = adapter_of_param(full_name)
                    if owner == adapter:
                        named.append((name, p.full_tensor() if isinstance(p, DTensor) else p.detach()))
            if lead:
                write_peft_adapter(named, replace(settings, adapters=()), base_model, Path(path) / adapter)
