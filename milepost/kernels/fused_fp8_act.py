"""FP8 activations made inside the kernels that make the activations (issue 23): RMSNorm (alone
or after the residual add) and SiLU-and-mul that also write their output's 1 x 128-block FP8
values and scales, bit for bit `quantize_act_1x128(y, 4)` of the output y the bf16 kernels give,
so the FP8 linear after them (milepost/lowprec/fp8_act.py) runs without a quantize launch.

The norms are fused_ops.py's kernels, called unchanged inside these ones; each program then reads
back the row it stored (after a CTA barrier: its other threads' stores are visible) and quantizes
it with fp8_quant.py's operations. Reading back through memory keeps the norm's reduction exactly
the bf16 kernel's (its register layout is not bent by the quantizer's [blocks, 128] shape), so
the normalized values, and from them the FP8 bits, are the unfused path's. SiLU * up has no
reduction: it is computed straight in the quantizer's shape. Rows past the activation's (padding
to a multiple of 4, which cuBLAS takes) get zeros and scale 1, as quantize_act_1x128 pads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from milepost.kernels.fp8_quant import TILE, quant_blocks_1x128
from milepost.kernels.fused_ops import _add_rms_norm_kernel, _rms_norm_kernel
from milepost.lowprec.fp8_act import PAD_ROWS, Fp8Act


@triton.jit
def _quant_row(Y, Q, S, row, stride_y, stride_q, stride_sm, stride_sk, n_groups,
               GROUPS: tl.constexpr):
    """Row `row` of Y (just stored by this program) -> its fp8 values in Q and scales in S."""
    g = tl.arange(0, GROUPS)
    ok = g < n_groups
    offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    y = tl.load(Y + row * stride_y + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    q, scale = quant_blocks_1x128(y)
    tl.store(Q + row * stride_q + offs, q, mask=ok[:, None])
    tl.store(S + row * stride_sm + g * stride_sk, scale, mask=ok)


@triton.jit
def _pad_row(Q, S, row, g, stride_q, stride_sm, stride_sk, n_groups, GROUPS: tl.constexpr):
    """Blocks g (GROUPS of them) of a padding row: fp8 zeros, scale 1 (quantize_act_1x128's)."""
    ok = g < n_groups
    offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(Q + row * stride_q + offs, tl.zeros((GROUPS, 128), tl.float32).to(tl.float8e4nv),
             mask=ok[:, None])
    tl.store(S + row * stride_sm + g * stride_sk, tl.full((GROUPS,), 1.0, tl.float32), mask=ok)


@triton.jit
def _rms_norm_fp8_kernel(X, W, Y, Q, S, stride_x, stride_y, stride_q, stride_sm, stride_sk,
                         n_rows, n_cols, n_groups, eps, BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row < n_rows:
        _rms_norm_kernel(X, W, Y, stride_x, stride_y, n_cols, eps, BLOCK)
        tl.debug_barrier()
        _quant_row(Y, Q, S, row, stride_y, stride_q, stride_sm, stride_sk, n_groups, GROUPS)
    else:
        _pad_row(Q, S, row, tl.arange(0, GROUPS), stride_q, stride_sm, stride_sk, n_groups, GROUPS)


@triton.jit
def _add_rms_norm_fp8_kernel(X, R, W, H, Y, Q, S, stride_x, stride_r, stride_h, stride_y, stride_q,
                             stride_sm, stride_sk, n_rows, n_cols, n_groups, eps,
                             BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if row < n_rows:
        _add_rms_norm_kernel(X, R, W, H, Y, stride_x, stride_r, stride_h, stride_y, n_cols, eps, BLOCK)
        tl.debug_barrier()
        _quant_row(Y, Q, S, row, stride_y, stride_q, stride_sm, stride_sk, n_groups, GROUPS)
    else:
        _pad_row(Q, S, row, tl.arange(0, GROUPS), stride_q, stride_sm, stride_sk, n_groups, GROUPS)


@triton.jit
def _silu_mul_fp8_kernel(G, U, Q, S, stride_g, stride_u, stride_q, stride_sm, stride_sk, n_rows,
                         n_groups, GROUPS: tl.constexpr):
    """GROUPS 1x128 blocks of one row: fused_ops._silu_mul_kernel's elementwise operations (the
    same bits in any layout), then the quantizer."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    if row < n_rows:
        ok = (g < n_groups)[:, None]
        offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        gate = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(U + row * stride_u + offs, mask=ok, other=0.0)
        dt = G.dtype.element_ty  # the activation's dtype (the bf16 kernel's output dtype)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # silu rounded like F.silu
        y = (act * up.to(tl.float32)).to(dt).to(tl.float32)
        q, scale = quant_blocks_1x128(y)
        tl.store(Q + row * stride_q + offs, q, mask=ok)
        tl.store(S + row * stride_sm + g * stride_sk, scale, mask=g < n_groups)
    else:
        _pad_row(Q, S, row, g, stride_q, stride_sm, stride_sk, n_groups, GROUPS)


def _outputs(t: int, k: int, what: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(fp8 values [Mp, K], M-major scales [Mp, K/128], Mp) as quantize_act_1x128 lays them out."""
    if k % TILE:
        raise ValueError(f"{what}: {k} columns are not whole 1x128 blocks; the FP8 activation "
                         "fusion needs K % 128 == 0 (call the bf16 kernel and quantize_act_1x128)")
    mp = -(-t // PAD_ROWS) * PAD_ROWS
    q = torch.empty((mp, k), dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty((k // TILE, mp), dtype=torch.float32, device=device).t()
    return q, s, mp


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Act:
    """x: [T, K] -> fused_ops.rms_norm(x, weight, eps) quantized per 1x128 block, in one launch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    q, s, mp = _outputs(t, k, "rms_norm_fp8", x.device)
    y = torch.empty((t, k), dtype=x.dtype, device=x.device)  # the normalized rows, read back
    if mp:
        _rms_norm_fp8_kernel[(mp,)](x, weight, y, q, s, x.stride(0), y.stride(0), q.stride(0),
                                    s.stride(0), s.stride(1), t, k, k // TILE, eps,
                                    BLOCK=triton.next_power_of_2(k),
                                    GROUPS=triton.next_power_of_2(k // TILE))
    return Fp8Act(q, s, t, x.dtype)


def add_rms_norm_fp8(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, Fp8Act]:
    """x, r: [T, K] -> (x + r, rms_norm(x + r) quantized per 1x128 block): fused_ops.add_rms_norm's
    values, in one launch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if r.stride(-1) != 1:
        r = r.contiguous()
    t, k = x.shape
    q, s, mp = _outputs(t, k, "add_rms_norm_fp8", x.device)
    h = torch.empty((t, k), dtype=x.dtype, device=x.device)
    y = torch.empty((t, k), dtype=x.dtype, device=x.device)
    if mp:
        _add_rms_norm_fp8_kernel[(mp,)](x, r, weight, h, y, q, s, x.stride(0), r.stride(0),
                                        h.stride(0), y.stride(0), q.stride(0), s.stride(0),
                                        s.stride(1), t, k, k // TILE, eps,
                                        BLOCK=triton.next_power_of_2(k),
                                        GROUPS=triton.next_power_of_2(k // TILE))
    return h, Fp8Act(q, s, t, x.dtype)


def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor) -> Fp8Act:
    """gate, up: [T, I] (row-contiguous, e.g. the halves of gate_up_proj's output) ->
    fused_ops.silu_mul(gate, up) quantized per 1x128 block, in one launch."""
    t, n = gate.shape
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_mul_fp8: gate and up must have contiguous rows")
    q, s, mp = _outputs(t, n, "silu_mul_fp8", gate.device)
    groups = min(8, triton.next_power_of_2(n // TILE))  # 1024 values a program, as silu_mul
    if mp:
        _silu_mul_fp8_kernel[(mp, triton.cdiv(n // TILE, groups))](
            gate, up, q, s, gate.stride(0), up.stride(0), q.stride(0), s.stride(0), s.stride(1),
            t, n // TILE, GROUPS=groups)
    return Fp8Act(q, s, t, gate.dtype)
