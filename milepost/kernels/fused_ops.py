"""Fused elementwise kernels for GPU inference: RMSNorm (alone or after the residual add), per-head
q/k RMSNorm + RoPE, SiLU-and-mul.

A decode step is dominated by many tiny launches: the torch versions of these ops take 7 (RMSNorm),
~17 (per-head norm + rotate-half RoPE) and 2 (SiLU * up) kernels each. Here each is one kernel that
reads its input once. Numerics follow layers.py: statistics in fp32, the normalized value rounded
to the model dtype before the weight multiply (transformers' order), RoPE with rotate-half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = (x * rstd).to(W.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] -> weight * normalize(x) in x's dtype (weight must share it)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), shape[-1], eps,
                                         BLOCK=triton.next_power_of_2(shape[-1]))
    return y.view(shape)


@triton.jit
def _add_rms_norm_kernel(X, R, W, H, Y, stride_x, stride_r, stride_h, stride_y, n_cols, eps,
                         BLOCK: tl.constexpr):
    """h = x + r rounded to the model dtype (torch's add), stored; y = RMSNorm(h) exactly as
    _rms_norm_kernel computes it from that stored h."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(H.dtype.element_ty)
    tl.store(H + row * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = (hf * rstd).to(W.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, r: [T, N] -> (x + r, rms_norm(x + r)) in one pass: the residual add before a norm (the
    same values as the add and then `rms_norm`, one launch and one read of the sum fewer)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if r.stride(-1) != 1:
        r = r.contiguous()
    t, n = x.shape
    h = torch.empty((t, n), dtype=x.dtype, device=x.device)
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        _add_rms_norm_kernel[(t,)](x, r, weight, h, y, x.stride(0), r.stride(0), h.stride(0),
                                   y.stride(0), n, eps, BLOCK=triton.next_power_of_2(n))
    return h, y


@triton.jit
def load_rounded(ptr, mask, stride_ps, SPLIT: tl.constexpr, DTYPE: tl.constexpr):
    """The values at ptr as fp32 (SPLIT 0), or, where a split GEMM left its output unsummed
    (lowprec/fp8_act.SplitSum), the sum of its SPLIT fp32 parts stride_ps apart, rounded to
    DTYPE: fp8_decode._sum_parts_kernel's order and rounding, so the same bits."""
    if SPLIT == 0:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros(ptr.shape, tl.float32)
    for p in tl.static_range(SPLIT):
        acc += tl.load(ptr + p * stride_ps, mask=mask, other=0.0)
    return acc.to(DTYPE).to(tl.float32)


@triton.jit
def norm_rope_rows(X, W, c, s, hh, hmask, i, eps, stride_xh, HALF: tl.constexpr,
                   HAS_NORM: tl.constexpr, DTYPE: tl.constexpr, stride_ps=0,
                   SPLIT: tl.constexpr = 0):
    """RoPE(RMSNorm_per_head(x)) of one token's head rows at X (norm skipped without HAS_NORM;
    SPLIT > 0: X holds a split GEMM's parts, load_rounded's): the two halves in DTYPE, each step
    rounded as transformers' RMSNorm and rotary do."""
    base = X + hh[:, None] * stride_xh + i[None, :]
    x1 = load_rounded(base, hmask, stride_ps, SPLIT, DTYPE)
    x2 = load_rounded(base + HALF, hmask, stride_ps, SPLIT, DTYPE)
    if HAS_NORM:
        ms = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        rstd = (1.0 / tl.sqrt(ms + eps))[:, None]
        w1 = tl.load(W + i).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + i).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(DTYPE).to(tl.float32) * w1).to(DTYPE).to(tl.float32)
        x2 = ((x2 * rstd).to(DTYPE).to(tl.float32) * w2).to(DTYPE).to(tl.float32)
    return (x1 * c - x2 * s).to(DTYPE), (x2 * c + x1 * s).to(DTYPE)


@triton.jit
def _norm_rope_kernel(X, W, COS, SIN, Y, stride_xt, stride_xh, stride_yt, stride_yh, stride_ct,
                      n_heads, eps, HALF: tl.constexpr, HEADS: tl.constexpr,
                      HAS_NORM: tl.constexpr):
    """One token, all its heads: [HEADS, HALF] halves of each head row at once."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, HEADS)
    hmask = (hh < n_heads)[:, None]
    i = tl.arange(0, HALF)
    # cos/sin rows are cat(freqs, freqs): the two halves share one table entry.
    c = tl.load(COS + t * stride_ct + i).to(tl.float32)[None, :]
    s = tl.load(SIN + t * stride_ct + i).to(tl.float32)[None, :]
    y1, y2 = norm_rope_rows(X + t * stride_xt, W, c, s, hh, hmask, i, eps, stride_xh, HALF,
                             HAS_NORM, Y.dtype.element_ty)
    out = Y + t * stride_yt + hh[:, None] * stride_yh + i[None, :]
    tl.store(out, y1, mask=hmask)
    tl.store(out + HALF, y2, mask=hmask)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] -> RoPE(RMSNorm_per_head(x)) (norm skipped when weight is None)."""
    t, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty((t, heads, dim), dtype=x.dtype, device=x.device)
    if t:
        _norm_rope_kernel[(t,)](
            x, weight if weight is not None else x, cos, sin, y, x.stride(0), x.stride(1),
            y.stride(0), y.stride(1), cos.stride(0), heads, eps, HALF=dim // 2,
            HEADS=triton.next_power_of_2(heads), HAS_NORM=weight is not None,
        )
    return y


@triton.jit
def _silu_mul_kernel(G, U, Y, stride_g, stride_u, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)  # silu rounded like F.silu
    tl.store(Y + row * stride_y + cols, (act * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, I] (row-contiguous) -> silu(gate) * up."""
    t, n = gate.shape
    y = torch.empty((t, n), dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(n))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate, up, y, gate.stride(0), up.stride(0),
                                                     y.stride(0), n, BLOCK=block)
    return y
