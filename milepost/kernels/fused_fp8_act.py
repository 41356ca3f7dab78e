"""FP8 activations made inside the kernels that make the activations (issue 23): RMSNorm (alone
or after the residual add) and SiLU-and-mul that also write their output's 1 x 128-block FP8
values and scales, bit for bit `quantize_act_1x128(y, 4)` of the output y the bf16 kernels give,
so the FP8 linear after them (milepost/lowprec/fp8_act.py) runs without a quantize launch.

The norms reduce each row's sum of squares exactly as fused_ops.py's kernels do (the same 1-D
shape, layout and so order), then normalize and quantize this program's 1 x 128 blocks straight
from registers: nothing is stored and read back, and the normalized row itself is never stored
(the linear reads only the FP8 bytes). A row may be split over programs
(each redoes the row's reduction) so that 64 decode rows fill the SMs. SiLU * up has no
reduction: it is computed straight in the quantizer's shape. Rows past the activation's (padding
to a multiple of 4, which cuBLAS takes) get zeros and scale 1, as quantize_act_1x128 pads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from milepost.kernels.fp8_quant import (
    TILE,
    early_launch,
    gdc_launch_dependents,
    quant_blocks_1x128,
)
from milepost.kernels.fused_ops import load_rounded
from milepost.lowprec.fp8_act import PAD_ROWS, Fp8Act, SplitSum


@triton.jit
def _pad_row(Q, S, row, g, stride_q, stride_sm, stride_sk, n_groups, GROUPS: tl.constexpr):
    """Blocks g (GROUPS of them) of a padding row: fp8 zeros, scale 1 (quantize_act_1x128's)."""
    ok = g < n_groups
    offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(Q + row * stride_q + offs, tl.zeros((GROUPS, 128), tl.float32).to(tl.float8e4nv),
             mask=ok[:, None])
    tl.store(S + row * stride_sm + g * stride_sk, tl.full((GROUPS,), 1.0, tl.float32), mask=ok)


@triton.jit
def _norm_fp8_kernel(X, R, W, H, Q, S, stride_x, stride_r, stride_rs, stride_h, stride_q,
                     stride_sm, stride_sk, n_rows, n_cols, n_groups, eps, ADD: tl.constexpr,
                     BLOCK: tl.constexpr, GROUPS: tl.constexpr, RSPLIT: tl.constexpr = 0,
                     TRIGGER: tl.constexpr = False):
    """Blocks [pid1 * GROUPS, + GROUPS) of row pid0 of RMSNorm(x) (ADD: of h = x + r, also
    stored; RSPLIT > 0: r is a split GEMM's fp32 parts, stride_rs apart: fused_ops.load_rounded),
    quantized per 1 x 128 block. Two passes over the row, both from the same loads'
    addresses (the second one hits the cache):
    1. the whole row in fused_ops' 1-D shape and operations: its sum of squares is reduced in
       the bf16 kernel's layout (BLOCK values, the same warps), so in its order: the same rstd;
    2. this program's blocks in the quantizer's [GROUPS, 128] shape: the norm's elementwise
       operations (the same bits in any layout) and the quantizer straight from registers.
    Every program of a row redoes pass 1 (it is a few KB from L2): a row split over programs
    keeps SMs busy at 64 rows without splitting the reduction (another order). TRIGGER: the
    decode GEMM reading Q may launch now (fp8_quant.PDL; it waits for this kernel's end)."""
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    if row < n_rows:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        xf = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # fused_ops._add_rms_norm_kernel's h, rounded to the model dtype
            rf = load_rounded(R + row * stride_r + cols, mask, stride_rs, RSPLIT, H.dtype.element_ty)
            xf = (xf + rf).to(H.dtype.element_ty).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        ok = (g < n_groups)[:, None]
        offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        if ADD:
            h = (x + load_rounded(R + row * stride_r + offs, ok, stride_rs, RSPLIT,
                                  H.dtype.element_ty)).to(H.dtype.element_ty)
            tl.store(H + row * stride_h + offs, h, mask=ok)
            x = h.to(tl.float32)
        w = tl.load(W + offs, mask=ok, other=0.0)
        y = (x * rstd).to(W.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
        q, scale = quant_blocks_1x128(y.to(X.dtype.element_ty).to(tl.float32))  # the stored y
        tl.store(Q + row * stride_q + offs, q, mask=ok)
        tl.store(S + row * stride_sm + g * stride_sk, scale, mask=g < n_groups)
    else:
        _pad_row(Q, S, row, g, stride_q, stride_sm, stride_sk, n_groups, GROUPS)


@triton.jit
def _silu_mul_fp8_kernel(G, U, Q, S, stride_g, stride_u, stride_q, stride_sm, stride_sk, n_rows,
                         n_groups, GROUPS: tl.constexpr, TRIGGER: tl.constexpr = False):
    """GROUPS 1x128 blocks of one row: fused_ops._silu_mul_kernel's elementwise operations (the
    same bits in any layout), then the quantizer. TRIGGER: as _norm_fp8_kernel's."""
    if TRIGGER:
        gdc_launch_dependents()
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


@triton.jit
def _quant_rows_kernel(X, Q, S, stride_x, stride_q, stride_sm, stride_sk, n_rows, n_groups,
                       GROUPS: tl.constexpr, TRIGGER: tl.constexpr = False):
    """GROUPS 1x128 blocks of one row quantized (_quant_act_kernel's operations, a warp per block
    row: no cross-warp reduction), or of a padding row filled. TRIGGER: as _norm_fp8_kernel's."""
    if TRIGGER:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    if row < n_rows:
        ok = (g < n_groups)[:, None]
        offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
        q, scale = quant_blocks_1x128(tl.load(X + row * stride_x + offs, mask=ok, other=0.0)
                                      .to(tl.float32))
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


# Blocks a program (powers of two; None: the rules below), settable for the kernel sweep
# (benchmarks/fp8_act_sweep.py): the bits are the same for any value (tests/unit).
GROUPS_PER_PROGRAM: int | None = None  # the norms'
SILU_GROUPS_PER_PROGRAM: int | None = None  # silu_mul_fp8's
QUANT_GROUPS_PER_PROGRAM: int | None = None  # quantize_rows_fp8's
# With split GEMM parts to add (fp8_act.SplitSum) every program of a row reads the whole row's
# parts for its sum of squares, so at most 2 programs a row (16 blocks each; None: the rule).
PARTS_GROUPS_PER_PROGRAM: int | None = 16


def _norm_groups(rows: int, n_groups: int, device: torch.device) -> int:
    """Blocks a norm program quantizes: 4 (512 columns), each program redoing its row's sum of
    squares. Fastest or tied of 1-32 at 64 and 256 rows of the 0.6B and 4B widths on an H100
    (benchmarks/fp8_act_sweep.py, 2026-12-06: 2.88 vs 3.62 us for the former fill-the-SMs rule
    at 64 rows of the 4B, 5.10 vs 7.37 at 256)."""
    if GROUPS_PER_PROGRAM is not None:
        return GROUPS_PER_PROGRAM
    return min(4, triton.next_power_of_2(n_groups))


def _norm(x: torch.Tensor, r: torch.Tensor | SplitSum | None, h: torch.Tensor | None,
          weight: torch.Tensor, eps: float, what: str) -> Fp8Act:
    """The norm kernel's launch: r and h (x + r's output) both given or both None."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rsplit, stride_rs = 0, 0
    if isinstance(r, SplitSum):
        if r.dtype != x.dtype or r.parts.shape[1:] != x.shape or not r.parts.is_contiguous():
            raise ValueError(f"{what}: split parts {tuple(r.parts.shape)} ({r.dtype}) do not "
                             f"make the added rows {tuple(x.shape)} ({x.dtype})")
        rsplit, stride_rs, r = r.parts.shape[0], r.parts.stride(0), r.parts[0]
    elif r is not None and r.stride(-1) != 1:
        r = r.contiguous()
    t, k = x.shape
    q, s, mp = _outputs(t, k, what, x.device)
    if mp:
        n_groups = k // TILE
        gp = _norm_groups(mp, n_groups, x.device)
        if rsplit and PARTS_GROUPS_PER_PROGRAM and GROUPS_PER_PROGRAM is None:
            gp = min(PARTS_GROUPS_PER_PROGRAM, triton.next_power_of_2(n_groups))
        rr, hh = (r, h) if r is not None else (x, x)  # unread and unwritten without ADD
        _norm_fp8_kernel[(mp, triton.cdiv(n_groups, gp))](
            x, rr, weight, hh, q, s, x.stride(0), rr.stride(0), stride_rs, hh.stride(0),
            q.stride(0), s.stride(0), s.stride(1), t, k, n_groups, eps, ADD=r is not None,
            RSPLIT=rsplit, BLOCK=triton.next_power_of_2(k), GROUPS=gp, **early_launch(x.device))
    return Fp8Act(q, s, t, x.dtype)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Act:
    """x: [T, K] -> fused_ops.rms_norm(x, weight, eps) quantized per 1x128 block, in one launch."""
    return _norm(x, None, None, weight, eps, "rms_norm_fp8")


def add_rms_norm_fp8(x: torch.Tensor, r: torch.Tensor | SplitSum, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, Fp8Act]:
    """x, r: [T, K] -> (x + r, rms_norm(x + r) quantized per 1x128 block): fused_ops.add_rms_norm's
    values, in one launch. r may be a split FP8 GEMM's unsummed parts (summed here, the same
    bits as r.summed())."""
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return h, _norm(x, r, h, weight, eps, "add_rms_norm_fp8")


def silu_mul_fp8(gate: torch.Tensor, up: torch.Tensor) -> Fp8Act:
    """gate, up: [T, I] (row-contiguous, e.g. the halves of gate_up_proj's output) ->
    fused_ops.silu_mul(gate, up) quantized per 1x128 block, in one launch."""
    t, n = gate.shape
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("silu_mul_fp8: gate and up must have contiguous rows")
    q, s, mp = _outputs(t, n, "silu_mul_fp8", gate.device)
    # 4 blocks a program: fastest or tied on an H100 (fp8_act_sweep.py: 3.09 vs 3.89 us for 8 at
    # 64 rows of the 4B)
    groups = SILU_GROUPS_PER_PROGRAM or min(4, triton.next_power_of_2(n // TILE))
    if mp:
        _silu_mul_fp8_kernel[(mp, triton.cdiv(n // TILE, groups))](
            gate, up, q, s, gate.stride(0), up.stride(0), q.stride(0), s.stride(0), s.stride(1),
            t, n // TILE, GROUPS=groups, **early_launch(gate.device))
    return Fp8Act(q, s, t, gate.dtype)


def quantize_rows_fp8(x: torch.Tensor) -> Fp8Act:
    """x: [T, K] (contiguous rows) -> `quantize_act_1x128(x, 4)`'s bits as an Fp8Act in one
    launch, padding rows included: a program quantizes 8 blocks of a row (1024 values) where
    _quant_act_kernel quantizes one with 4 warps. For an activation no fused kernel makes (the
    attention output before o_proj); benchmarks/fp8_act_sweep.py times the two."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, k = x.shape
    q, s, mp = _outputs(t, k, "quantize_rows_fp8", x.device)
    groups = QUANT_GROUPS_PER_PROGRAM or min(8, triton.next_power_of_2(k // TILE))
    if mp:
        _quant_rows_kernel[(mp, triton.cdiv(k // TILE, groups))](
            x, q, s, x.stride(0), q.stride(0), s.stride(0), s.stride(1), t, k // TILE, GROUPS=groups,
            **early_launch(x.device))
    return Fp8Act(q, s, t, x.dtype)
