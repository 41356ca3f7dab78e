"""Packed causal attention for training on CUDA: one FlashAttention-2 varlen call per layer.

PyTorch ships FlashAttention-2 (`aten::_flash_attention_forward/backward`) with the varlen
(cu_seqlens) entry points and native GQA (fewer K/V heads than Q heads). Wrapping the two ops in
an autograd Function gives a forward and a backward over all packed sequences in one launch each,
instead of one SDPA call per sequence (and its slice gradients). Only the positional arguments and
`scale=` are passed, because the ops' keyword tails changed between torch releases.
"""

from __future__ import annotations

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_varlen_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when FlashAttention-2 can run these q/k ([T, H, D] / [T, Hkv, D]) on this device."""
    if not q.is_cuda or q.dtype not in FLASH_DTYPES or k.dtype != q.dtype:
        return False
    d = q.shape[-1]
    if d % 8 or d > 256 or q.shape[1] % k.shape[1]:
        return False
    major, _ = torch.cuda.get_device_capability(q.device)
    return major >= 8


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_len: int, scale: float):  # type: ignore[override]
        out, lse, rng_a, rng_b, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng_a, rng_b)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, cu, rng_a, rng_b = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True,
            rng_a, rng_b, scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None


def flash_varlen_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] (bf16/fp16, CUDA), cu_seqlens: [B+1] int32 -> [T, H, D].

    Causal attention inside each span [cu[i], cu[i+1]); max_len is the longest span.
    """
    return _FlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, max_len, scale)
