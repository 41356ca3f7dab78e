"""One-pass FP8 blockwise quantizers for the trainer's native FP8 linears (issue 23 profile).

Today's trainer path quantizes each weight with the torch quantizer (~15 passes over the weight
in float32 per forward) and makes the weight-gradient GEMM's operands by `F.pad(t.t())` (a copy
that keeps the transposed strides) then `.contiguous()` (a second, transposing copy) before the
1 x 128 Triton quantizer. These kernels give the same bits in one pass each:

- `quantize_weight_tiles`: a weight [N, K] (whole 128 x 128 tiles) -> float8 values, float32 tile
  scales, and optionally the values transposed [K, N] (what the data-gradient GEMM reads), so the
  backward needs no fp8 transpose copy.
- `quantize_blocks`: any strided 2-d view `a` [R, C] quantized per 1 x 128 block along C, rows
  padded to `pad_rows`, columns to `pad_cols` (zeros; a block of zeros gets scale 1), scales
  M-major as `quantize_act_1x128` lays them out. With `a = x.t()` it is the weight-gradient
  operand without any copy; with a row-major `a` it is `quantize_act_1x128` with 64 rows a
  program instead of one block.
- `quantize_tensor_t`: the delayed recipe's per-tensor quantizer (`quantize_tensor_e4m3`'s
  elements and amax) that also writes the values transposed with the tokens padded, the
  weight-gradient GEMM's operand, instead of a later fp8 transposing copy.

Element rule (`fp8_quant._round_e4m3`): scale = amax / 448 (IEEE division; 1 where amax is 0,
NaN where the block holds NaN/Inf), value = x / scale rounded to nearest even, saturating at 448:
milepost.lowprec.quantize's bits (tests/unit/test_fp8_train_quant.py, under the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from milepost.kernels.fp8_quant import TILE, _round_e4m3

ROWS = 64  # rows of 1 x 128 blocks a program: a transposed bf16 read then spans 128-byte lines


@triton.jit
def _weight_kernel(W, Q, QT, S, N, K, stride_w, stride_q, stride_qt, stride_s, WRITE_T: tl.constexpr,
                   BLOCK: tl.constexpr):
    pn, pk = tl.program_id(0), tl.program_id(1)
    rn = pn * BLOCK + tl.arange(0, BLOCK)
    rk = pk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]).to(tl.float32)
    finite = tl.abs(x) < float("inf")  # False for NaN and +-Inf
    amax = tl.max(tl.max(tl.where(finite, tl.abs(x), 0.0), 1), 0)
    bad = tl.min(tl.min(finite.to(tl.int32), 1), 0) == 0
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    scale = tl.where(bad, float("nan"), scale)
    r = _round_e4m3(tl.math.div_rn(x, scale))
    tl.store(Q + rn[:, None].to(tl.int64) * stride_q + rk[None, :], r.to(tl.float8e4nv))
    if WRITE_T:  # the same bytes at [k, n]: the data-gradient GEMM's operand
        tl.store(QT + rk[:, None].to(tl.int64) * stride_qt + rn[None, :], tl.trans(r).to(tl.float8e4nv))
    tl.store(S + pn * stride_s + pk, scale)


def quantize_weight_tiles(w: torch.Tensor, transposed: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """w [N, K] (N, K multiples of 128) -> (float8_e4m3fn [N, K], float32 [N/128, K/128],
    float8 [K, N] = the values transposed, or None): `quantize(w, "fp8_block")`'s values and
    scales, read once."""
    n, k = w.shape
    if n % TILE or k % TILE:
        raise ValueError(f"quantize_weight_tiles needs whole 128 x 128 tiles, got a weight of shape "
                         f"{[n, k]}; partial tiles go through milepost.lowprec.quantize")
    w = w.detach()
    if w.stride(1) != 1:
        w = w.contiguous()
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    qt = torch.empty((k, n), dtype=torch.float8_e4m3fn, device=w.device) if transposed else q
    s = torch.empty((n // TILE, k // TILE), dtype=torch.float32, device=w.device)
    _weight_kernel[(n // TILE, k // TILE)](w, q, qt, s, n, k, w.stride(0), q.stride(0), qt.stride(0),
                                           s.stride(0), WRITE_T=transposed, BLOCK=TILE, num_warps=8)
    return q, s, (qt if transposed else None)


@triton.jit
def _blocks_kernel(A, Q, S, R, C, RP, stride_ar, stride_ac, stride_q, stride_sr, stride_sc,
                   ROWS_PER: tl.constexpr, BLOCK: tl.constexpr):
    pr, pc = tl.program_id(0), tl.program_id(1)
    rr = pr * ROWS_PER + tl.arange(0, ROWS_PER)
    cc = pc * BLOCK + tl.arange(0, BLOCK)
    inside = (rr[:, None] < R) & (cc[None, :] < C)  # padding rows / columns read as 0
    a = tl.load(A + rr[:, None].to(tl.int64) * stride_ar + cc[None, :].to(tl.int64) * stride_ac,
                mask=inside, other=0.0).to(tl.float32)
    finite = tl.abs(a) < float("inf")
    amax = tl.max(tl.where(finite, tl.abs(a), 0.0), 1)
    bad = tl.min(finite.to(tl.int32), 1) == 0
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    scale = tl.where(bad, float("nan"), scale)
    r = _round_e4m3(tl.math.div_rn(a, scale[:, None]))
    kept = rr < RP  # the last program's rows past the padded count
    tl.store(Q + rr[:, None].to(tl.int64) * stride_q + cc[None, :], r.to(tl.float8e4nv), mask=kept[:, None])
    tl.store(S + rr.to(tl.int64) * stride_sr + pc * stride_sc, scale, mask=kept)


def quantize_blocks(a: torch.Tensor, pad_rows: int = 1, pad_cols: int = TILE
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """a [R, C] (any strides; C padded to a multiple of `pad_cols`, itself a multiple of 128) ->
    (float8_e4m3fn [Rp, Cp] row-major, float32 [Rp, Cp/128] stored M-major), Rp = R rounded up
    to `pad_rows`. Bits: `quantize_act_1x128(F.pad(a, (0, Cp - C)).contiguous(), pad_rows)`."""
    if pad_cols % TILE:
        raise ValueError(f"quantize_blocks: pad_cols must be a multiple of {TILE}, got {pad_cols}")
    r, c = a.shape
    rp, cp = -(-r // pad_rows) * pad_rows, -(-c // pad_cols) * pad_cols
    q = torch.empty((rp, cp), dtype=torch.float8_e4m3fn, device=a.device)
    s = torch.empty((cp // TILE, rp), dtype=torch.float32, device=a.device).t()
    if rp and cp:
        a = a.detach()
        grid = (triton.cdiv(rp, ROWS), cp // TILE)
        _blocks_kernel[grid](a, q, s, r, c, rp, a.stride(0), a.stride(1), q.stride(0), s.stride(0),
                             s.stride(1), ROWS_PER=ROWS, BLOCK=TILE, num_warps=8)
    return q, s



@triton.jit
def _tensor_t_kernel(X, Q, QT, S, AMAX, BAD, R, C, RP, stride_x, stride_q, stride_qt,
                     ROWS_PER: tl.constexpr, BLOCK: tl.constexpr):
    pr, pc = tl.program_id(0), tl.program_id(1)
    rr = pr * ROWS_PER + tl.arange(0, ROWS_PER)
    cc = pc * BLOCK + tl.arange(0, BLOCK)
    inside = (rr[:, None] < R) & (cc[None, :] < C)
    x = tl.load(X + rr[:, None].to(tl.int64) * stride_x + cc[None, :], mask=inside, other=0.0).to(tl.float32)
    finite = tl.abs(x) < float("inf")  # masked lanes are 0: finite, no amax
    part = pr * tl.num_programs(1) + pc
    tl.store(AMAX + part, tl.max(tl.max(tl.where(finite, tl.abs(x), 0.0), 1), 0))
    tl.store(BAD + part, 1 - tl.min(tl.min(finite.to(tl.int32), 1), 0))
    r = tl.where(inside, _round_e4m3(tl.math.div_rn(x, tl.load(S))), 0.0)  # padding: +0 bytes
    tl.store(Q + rr[:, None].to(tl.int64) * stride_q + cc[None, :], r.to(tl.float8e4nv), mask=inside)
    kept = (cc[:, None] < C) & (rr[None, :] < RP)
    tl.store(QT + cc[:, None].to(tl.int64) * stride_qt + rr[None, :], tl.trans(r).to(tl.float8e4nv), mask=kept)


def quantize_tensor_t(x: torch.Tensor, scale: torch.Tensor, pad_rows: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, C] under one float32 0-d `scale` -> (float8 [R, C], float8 [C, Rp] = the same
    values transposed with R zero-padded to `pad_rows` (+0 bytes), float32 0-d amax of the finite
    values, bool 0-d "holds NaN/Inf"): `fp8_quant.quantize_tensor_e4m3`'s elements and amax, and
    the operand the per-tensor weight-gradient GEMM reads, in one pass. No host sync."""
    r, c = x.shape
    rp = -(-r // pad_rows) * pad_rows
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((r, c), dtype=torch.float8_e4m3fn, device=x.device)
    qt = torch.empty((c, rp), dtype=torch.float8_e4m3fn, device=x.device)
    grid = (max(1, triton.cdiv(rp, ROWS)), max(1, triton.cdiv(c, TILE)))
    amax = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    bad = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    if rp and c:
        _tensor_t_kernel[grid](x.detach(), q, qt, scale.float().contiguous(), amax, bad, r, c, rp,
                               x.stride(0), q.stride(0), qt.stride(0), ROWS_PER=ROWS, BLOCK=TILE, num_warps=8)
    return q, qt, amax.amax(), bad.amax() > 0
