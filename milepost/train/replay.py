"""Rollout routing replay (R3, report 2.5): the trainer's MoE layers use the engine's expert ids.

The engine returns, per sample, base64 int32 [len(tokens) - 1, layers, top_k]: the experts every
token but the last was routed to (the last token is never forwarded: it is only a target). The
trainer packs those into `forced_experts` [T, layers, top_k] for its forward; the MoE block then
computes the router's probabilities at the forced ids, so the router still gets gradients.
`RoutingProbe` measures how often the trainer's own (natural) top-k would have picked other experts.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Self

import numpy as np
import torch
from torch import nn


def decode_routed_experts(data: str, num_tokens: int, num_layers: int, top_k: int) -> torch.Tensor:
    """SGLang's base64 int32 routing of one sample -> [num_tokens - 1, num_layers, top_k] int32."""
    raw = np.frombuffer(base64.b64decode(data), dtype=np.int32)
    want = (num_tokens - 1) * num_layers * top_k
    if raw.size != want:
        raise ValueError(
            f"routed_experts holds {raw.size} ids, expected (tokens-1={num_tokens - 1}) x (layers={num_layers}) "
            f"x (top_k={top_k}) = {want}; the engine's model does not match the trainer's "
            "(--use-rollout-routing-replay needs the same MoE checkpoint on both sides)"
        )
    return torch.from_numpy(raw.copy()).reshape(num_tokens - 1, num_layers, top_k)


def samples_routing(samples: Sequence, num_layers: int, top_k: int) -> list[torch.Tensor]:
    """Every sample's routing decoded ([len(tokens) - 1, layers, top_k]); refuses samples without one."""
    missing = [i for i, s in enumerate(samples) if not s.routed_experts]
    if missing:
        raise ValueError(
            f"--use-rollout-routing-replay: samples {missing[:5]} carry no routed_experts; the rollout "
            "must ask the engine for them (return_routed_experts)"
        )
    return [decode_routed_experts(s.routed_experts, len(s.tokens), num_layers, top_k) for s in samples]


def forced_for_pack(routed: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-sample routings [len_i - 1, L, k] into [sum len_i, L, k] int64 for a packed
    forward. Each sequence's last token gets a copy of the row before it: its output feeds no
    log-prob (causal attention, and it is only a target), so any valid ids do."""
    rows = []
    for r in routed:
        rows += [r, r[-1:]]
    return torch.cat(rows).to(torch.int64)


def valid_rows(routed: Sequence[torch.Tensor]) -> torch.Tensor:
    """[T] bool: True for rows that carry a real rollout routing (every row but each sequence's last)."""
    flags = []
    for r in routed:
        flags += [torch.ones(r.shape[0], dtype=torch.bool), torch.zeros(1, dtype=torch.bool)]
    return torch.cat(flags)


def _moe_blocks(module: nn.Module) -> list[nn.Module]:
    from milepost.models.qwen3_moe import SparseMoeBlock

    return [m for m in module.modules() if isinstance(m, SparseMoeBlock)]


def is_moe(module: nn.Module) -> bool:
    return bool(_moe_blocks(module))


class RoutingProbe:
    """While entered, every MoE block that runs with forced experts also computes its router's
    natural top-k (no grad) and counts the tokens whose expert set differs in any layer.

    `set_valid(mask [T])` before each forward says which rows to count (filler rows are not).
    """

    def __init__(self, module: nn.Module) -> None:
        self.blocks = _moe_blocks(module)
        self.handles: list = []
        self.differs: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.tokens = 0.0
        self.tokens_differing = 0.0

    def __enter__(self) -> Self:
        self.handles = [b.register_forward_hook(self._hook) for b in self.blocks]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def set_valid(self, valid: torch.Tensor) -> None:
        self.flush()
        self.valid = valid
        self.differs = torch.zeros_like(valid)

    def _hook(self, block: nn.Module, args: tuple, output: torch.Tensor) -> None:
        x, ctx = args[0], args[1] if len(args) > 1 else None
        if ctx is None or ctx.forced_experts is None or self.differs is None:
            return
        with torch.no_grad():
            probs = torch.softmax(block.gate(x).float(), dim=-1)
            natural = torch.topk(probs, block.top_k, dim=-1).indices.sort(dim=-1).values
            forced = ctx.forced_experts[:, block.layer_id, :].to(natural.device).sort(dim=-1).values
            self.differs |= (natural != forced).any(dim=-1).to(self.differs.device)

    def flush(self) -> None:
        """Add the last forward's counts (its rows that carry a rollout routing)."""
        if self.differs is not None and self.valid is not None:
            self.tokens += float(self.valid.sum())
            self.tokens_differing += float((self.differs & self.valid).sum())
        self.differs = self.valid = None
