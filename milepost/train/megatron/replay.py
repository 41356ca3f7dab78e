"""Rollout routing replay (R3) on megatron-core's own router replay (`moe_enable_routing_replay`).

Before a forward, each MoE layer's `RouterReplay` gets the engine's expert ids of this rank's
packed tokens ([T, top_k] for that layer) and replays them (REPLAY_FORWARD: the router's scores
gathered at those ids, so it still gets gradients); after it, the targets are cleared. A forward
hook on each router counts, like the FSDP backend's RoutingProbe, the tokens whose natural top-k
(computed from the same logits, no grad) differs from the replayed one in any layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import Self


def moe_routers(model: Any) -> list[tuple[int, Any]]:
    """(global layer index, TopKRouter) of every MoE layer of this model shard (pp = 1)."""
    out = []
    for i, layer in enumerate(model.decoder.layers):
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            out.append((i, router))
    return out


class ReplayRouting:
    """Context for one forward: replay `forced` [T, layers, top_k] (None = natural routing)."""

    def __init__(self, model: Any, forced: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        self.routers = moe_routers(model) if forced is not None else []
        self.forced, self.valid = forced, valid
        self.differs: torch.Tensor | None = None
        self.handles: list = []

    def __enter__(self) -> Self:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.forced is None:
            return self
        self.differs = torch.zeros(self.forced.shape[0], dtype=torch.bool, device=self.forced.device)
        for layer, router in self.routers:
            replay = router.router_replay
            replay.clear_indices()
            replay.set_target_indices(self.forced[:, layer, :])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            self.handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def _hook(self, layer: int):
        def hook(router: Any, args: tuple, output: Any) -> None:
            with torch.no_grad():
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                natural = torch.topk(F.linear(x, router.weight.float()), router.topk, dim=-1).indices
                forced = self.forced[:, layer, :].to(natural.device)
                self.differs |= (natural.sort(-1).values != forced.sort(-1).values).any(-1)
        return hook

    def __exit__(self, *exc: object) -> None:
        for _, router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        for h in self.handles:
            h.remove()
        self.handles = []

    def counts(self) -> tuple[float, float]:
        """(rows with a rollout routing, of which differing from the natural routing in any layer)."""
        if self.differs is None or self.valid is None:
            return 0.0, 0.0
        valid = self.valid.to(self.differs.device)
        return float(valid.sum()), float((self.differs & valid).sum())
