"""Gated-SiLU experts as two grouped GEMMs (`torch._grouped_mm`) over tokens sorted by expert.

Every (token, slot) pair is sorted by expert id on the device; group boundaries are a cumulative
count, so nothing syncs with the host and the whole block can be captured in a CUDA graph. On
Hopper with bf16 torch runs CUTLASS grouped kernels; elsewhere its fallback loops over groups.
Results are merged per token in slot order (a gather, no atomics): deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from milepost.kernels.fused_ops import (
        silu_mul as fused,  # triton: imported on GPU only
    )

    return fused(gate, up)


def grouped_available(x: torch.Tensor) -> bool:
    """CUDA inference in bf16 (CUTLASS grouped kernels on sm90+). CPU, other dtypes and anything
    outside inference_mode (the trainer) keep the per-expert loop, whose numerics it was checked with."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.is_inference_mode_enabled()
            and hasattr(torch, "_grouped_mm"))


def fused_config(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> object | None:
    """Under grouped_available: the Triton fused MoE config (kernels/fused_moe.py) where it was
    measured faster than the grouped GEMMs for this expert shape and token count, else None."""
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return None
    from milepost.kernels.fused_moe import config_for  # triton: imported on GPU only

    return config_for(x.shape[0], w13.shape[0], w13.shape[2], w2.shape[2], ids.shape[1])


def grouped_train_available(x: torch.Tensor) -> bool:
    """The trainer on CUDA in bf16 (outside inference_mode): torch's grouped GEMM has a backward."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def grouped_expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, act: Callable | None = None) -> torch.Tensor:
    """x: [T, H], ids: [T, k] int64, weights: [T, k]; w13: [E, 2I, H], w2: [E, H, I] -> [T, H].

    act(gate, up): the SiLU-and-mul to use (default: the inference kernel on CUDA; the trainer
    passes train_fused.silu_mul, which has a backward)."""
    t, k = ids.shape
    num_experts = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair index, grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # group ends
    xs = x.index_select(0, order // k)  # [T*k, H]
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    if act is not None:
        act = act(gate, up)
    else:
        act = silu_mul(gate, up) if x.is_cuda else F.silu(gate) * up
    ys = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)  # [T*k, H]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=x.device)
    y = ys.index_select(0, inverse).view(t, k, -1)  # back to (token, slot) order
    return (y * weights.to(y.dtype)[:, :, None]).sum(dim=1)
