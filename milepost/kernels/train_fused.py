"""Fused training kernels (Triton, forward and backward): RMSNorm, rotate-half RoPE, SiLU-and-mul.

The trainer's torch versions launch many small elementwise kernels each (fp32 casts, pow, mean,
rsqrt, muls, cat for RoPE) and keep their fp32 intermediates for backward; a train-step profile
showed elementwise work ahead of the matrix multiplies. Each op here is one kernel forward and one
backward, computing in fp32 from bf16/fp16 inputs. Numerics follow milepost/models/layers.py (the
normalized value is rounded to the model dtype before the weight multiply, SiLU rounded before
the multiply), so outputs agree with the torch path to bf16 rounding; gradients treat those
roundings as identity, as autograd does. The torch path stays the reference (CPU and tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FUSED_DTYPES = (torch.bfloat16, torch.float16)


def fused_training_supported(x: torch.Tensor) -> bool:
    """True when these kernels can run on x: a CUDA tensor in bf16/fp16 (the trainer's compute)."""
    return x.is_cuda and x.dtype in FUSED_DTYPES


# --- RMSNorm ---------------------------------------------------------------------------------------


@triton.jit
def _rms_fwd(X, W, Y, RSTD, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < n_cols)[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / n_cols + eps)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    normed = (x * rstd[:, None]).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + offs, (normed * w[None, :]).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _rms_bwd(DY, X, W, RSTD, DX, DW_PART, n_rows, n_cols, tiles_per_prog,
             ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Each program takes `tiles_per_prog` consecutive row tiles and writes its partial dW row."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(tiles_per_prog):
        rows = (pid * tiles_per_prog + i) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)[:, None]
        xhat = x * rstd
        dw += tl.sum(dy * xhat.to(X.dtype.element_ty).to(tl.float32), 0)
        dn = dy * w[None, :]
        dx = rstd * (dn - xhat * (tl.sum(dn * xhat, 1) / n_cols)[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * n_cols + cols, dw, mask=cmask)


def _rows_per_tile(n_cols: int) -> int:
    return max(1, min(16, 4096 // triton.next_power_of_2(n_cols)))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):  # type: ignore[override]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        n_rows, n_cols = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        rows, block = _rows_per_tile(n_cols), triton.next_power_of_2(n_cols)
        if n_rows:
            _rms_fwd[(triton.cdiv(n_rows, rows),)](x2, weight, y, rstd, n_rows, n_cols, eps, ROWS=rows, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, weight, rstd = ctx.saved_tensors
        n_rows, n_cols = x2.shape
        dy2 = dy.reshape(-1, n_cols).contiguous()
        dx = torch.empty_like(x2)
        rows, block = _rows_per_tile(n_cols), triton.next_power_of_2(n_cols)
        tiles = triton.cdiv(n_rows, rows)
        # Enough programs to fill the device; each writes one fp32 partial row of dW.
        progs = max(1, min(tiles, 4 * _sm_count(x2.device)))
        per_prog = triton.cdiv(tiles, progs)
        progs = triton.cdiv(tiles, per_prog)
        partial = torch.empty(progs, n_cols, dtype=torch.float32, device=x2.device)
        if n_rows:
            _rms_bwd[(progs,)](dy2, x2, weight, rstd, dx, partial, n_rows, n_cols, per_prog, ROWS=rows, BLOCK=block)
            dw = partial.sum(0).to(weight.dtype)
        else:
            dw = torch.zeros_like(weight)
        return dx.view(ctx.shape), dw, None


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the Triton interpreter (CPU tests)
    return torch.cuda.get_device_properties(device).multi_processor_count


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N], weight: [N] (x's dtype) -> weight * round(x * rsqrt(mean(x^2) + eps)), with backward."""
    return _RMSNorm.apply(x, weight, eps)


# --- RoPE ------------------------------------------------------------------------------------------


@triton.jit
def _rope(X, COS, SIN, Y, n_heads, sign, HALF: tl.constexpr, HEADS: tl.constexpr):
    """One token, all heads. sign=+1 rotates (forward), -1 rotates back (the transpose: backward)."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, HEADS)
    i = tl.arange(0, HALF)
    hmask = (hh < n_heads)[:, None]
    base = t * n_heads * 2 * HALF + hh[:, None] * (2 * HALF) + i[None, :]
    x1 = tl.load(X + base, mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(X + base + HALF, mask=hmask, other=0.0).to(tl.float32)
    # cos/sin rows are cat(freqs, freqs): both halves use the first half's entries.
    c = tl.load(COS + t * 2 * HALF + i).to(tl.float32)[None, :]
    s = sign * tl.load(SIN + t * 2 * HALF + i).to(tl.float32)[None, :]
    tl.store(Y + base, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=hmask)
    tl.store(Y + base + HALF, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=hmask)


def _rope_launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    t, heads, dim = x.shape
    y = torch.empty_like(x)
    if t:
        _rope[(t,)](x, cos, sin, y, heads, sign, HALF=dim // 2, HEADS=triton.next_power_of_2(heads))
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):  # type: ignore[override]
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x.contiguous(), cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rope_launch(dy.contiguous(), cos, sin, -1.0), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], cos/sin: [T, head_dim] (no gradient) -> rotated x, with backward."""
    return _Rope.apply(x, cos, sin)


# --- SiLU and multiply (SwiGLU) --------------------------------------------------------------------


@triton.jit
def _silu_mul_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)  # rounded like F.silu
    tl.store(Y + offs, (act * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    act = (g * sig).to(DU.dtype.element_ty).to(tl.float32)
    tl.store(DU + offs, (dy * act).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)


_SILU_BLOCK = 1024


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _silu_mul_fwd[(triton.cdiv(n, _SILU_BLOCK),)](gate, up, y, n, BLOCK=_SILU_BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _silu_mul_bwd[(triton.cdiv(n, _SILU_BLOCK),)](dy, gate, up, dg, du, n, BLOCK=_SILU_BLOCK)
        return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: same shape -> round(silu(gate)) * up, with backward."""
    return _SiluMul.apply(gate, up)
