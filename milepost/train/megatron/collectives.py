"""The Megatron backend's collectives over its parallel groups: gradient sums (data, expert-data,
tensor and embedding groups), the global gradient norm and clip, and the unsharded weights.

Functions of a `MegatronBackend` (milepost/train/megatron/backend.py), which owns the groups.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from milepost.train.megatron.convert import unshard

if TYPE_CHECKING:
    from milepost.train.megatron.backend import MegatronBackend


def sync_gradients(b: MegatronBackend) -> None:
    """Sum gradients over the ranks that hold the same weights with different data.

    Dense weights: the data-parallel group. Experts (megatron marks them allreduce=False): the
    expert-data-parallel group (expert tensor parallel size 1). Summed over TP too, as
    megatron's finalize_model_grads does: Qwen3's per-head q/k norms (replicated, but each TP
    rank sees its heads only) and, under sequence parallel (MoE with TP), the weights marked
    `sequence_parallel` (norms, router: each TP rank sees its part of the sequence).
    Distributed optimizer: the same sums on DDP's `main_grad`, the TP and embedding ones first
    (on every rank's whole local gradient), then megatron's reduce-scatter over data parallel.
    """
    tp_sum = b.sizes.tp > 1
    sp = tp_sum and b.shape.is_moe
    for name, p in b.policy.named_parameters():
        if b.dist_adam is not None:
            grad = p.main_grad
        else:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # an expert no token reached: still in the collective
            grad = p.grad
        if b.sizes.pp > 1 and getattr(p, "shared_embedding", False):
            # the tied embedding's copies on the first and last stage: one gradient, one update
            dist.all_reduce(grad, group=embedding_group())
        if tp_sum and ("q_layernorm" in name or "k_layernorm" in name
                       or (sp and getattr(p, "sequence_parallel", False))):
            dist.all_reduce(grad, group=b._tp_group)
        if b.dist_adam is not None:
            continue  # data parallel: the reduce-scatter below
        if getattr(p, "allreduce", True):
            if b.data_world > 1:
                dist.all_reduce(p.grad, group=b._dp_group)
        elif dist.get_world_size(b._edp_group) > 1:
            dist.all_reduce(p.grad, group=b._edp_group)
    if b.dist_adam is not None:
        b.dist_adam.reduce_scatter()


def clip_gradients(b: MegatronBackend, clip: float) -> float:
    """Global L2 norm (each weight counted once over TP and EP), then torch's clip rule."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    dense = torch.zeros((), dtype=torch.float64, device=b.device)
    expert = torch.zeros((), dtype=torch.float64, device=b.device)
    for p in b.policy.parameters():
        if getattr(p, "shared", False):
            continue  # the last stage's copy of a tied embedding: counted on the first stage
        if not getattr(p, "allreduce", True):
            expert += p.grad.double().pow(2).sum()
        elif param_is_not_tensor_parallel_duplicate(p):
            dense += p.grad.double().pow(2).sum()
    dist.all_reduce(dense, group=b._tp_group)
    dist.all_reduce(expert, group=b._ep_group)
    if b.sizes.pp > 1:
        dist.all_reduce(dense, group=b._pp_group)
        dist.all_reduce(expert, group=b._pp_group)
    norm = float((dense + expert).sqrt())
    if clip > 0 and math.isfinite(norm):
        coef = clip / (norm + 1e-6)
        if coef < 1.0:
            for p in b.policy.parameters():
                p.grad.mul_(coef)
    return norm


def full_megatron_state(b: MegatronBackend) -> dict[str, torch.Tensor]:
    """Every weight, unsharded, under TP=PP=EP=1 Megatron names (a collective over TP, EP, PP)."""
    tp, ep, pp = b.sizes.tp, b.sizes.ep, b.sizes.pp
    pieces: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {
        (t, 0, e): {} for t in range(tp) for e in range(ep)}
    with torch.no_grad():
        for name, p in b.policy.named_parameters():
            expert = not getattr(p, "allreduce", True)
            group, size = (b._ep_group, ep) if expert else (b._tp_group, tp)
            parts = [torch.empty_like(p) for _ in range(size)]
            if size > 1:
                dist.all_gather(parts, p.detach().contiguous(), group=group)
            else:
                parts = [p.detach().clone()]
            for r, part in enumerate(parts):
                for t in range(tp) if expert else [r]:
                    for e in [r] if expert else range(ep):
                        pieces[(t, 0, e)][name] = part
    if pp > 1:  # each stage's pieces (local layer numbers) to every stage, through host memory
        stages: list = [None] * pp
        dist.all_gather_object(stages, {k: {n: t.cpu() for n, t in v.items()} for k, v in pieces.items()},
                               group=b._pp_group)
        pieces = {(t, s, e): part for s, stage in enumerate(stages) for (t, _, e), part in stage.items()}
    full = unshard(b.shape, pieces, tp=tp, pp=pp, ep=ep)
    if b.shape.tied_embeddings:
        full.pop("output_layer.weight", None)
    return full


def embedding_group() -> Any:
    from megatron.core import parallel_state as ps

    return ps.get_embedding_group()
