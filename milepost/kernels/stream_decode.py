"""Stream-K decode GEMMs: y = x @ W^T at decode M (a few to a few hundred rows), where reading the
weight is the whole cost, by one wave of persistent programs that each stream an equal share of
the weight's (column tile, K block) units.

Why (issue 23): the split-K decode kernel (fp8_decode.py) gives every program whole tiles times a
fixed K split, so a shape's programs rarely divide the SMs evenly (the 4B gate_up at 64-wide
tiles: 304 tiles for 132 SMs, 2 or 3 per SM) and each program's pipeline fills and drains per
tile; on an H200 its 4B projections ran at 1.2-2.5 TB/s, no faster than cuBLAS's bf16 GEMMs on
twice the bytes. Here the units are laid out column tile after column tile, K blocks within a
tile, and program p of P takes units [p U / P, (p + 1) U / P) (rounded down) of the U: every SM
reads the same number of weight bytes, give or take one unit, and one pipelined loop runs across tile boundaries (the flattened loop of Triton's
persistent matmul).

A tile whose K blocks one program covers is stored by it. A tile split between programs (at most
two per program: where its range starts and where it ends) has each piece stored, fp32, in the
program's slot (0: its first tile, 1: its last); the pieces are then summed in K order, 0 +
first + ... + last, by the piece that finishes last (`ticket`: an atomic counter per tile picks
that program; no value is accumulated atomically) or by a second kernel: the same sums either
way. So the output never depends on timing, only on (M block, shape, programs): a fixed
association, as the split-K kernel's.

Operands: fp8 (`float8_e4m3fn`) weights with 128 x 128 scales and activations quantized per
1 x 128 block (each K block's product scaled by both scales, DeepSeek-V3's recipe, as the
split-K kernel: the same per-block products), or bf16/fp16 weights and activations (the MMA
accumulates directly). `swap` puts the weight rows on the MMA's M side (the rows of x on its N
side, which can be as small as 8 rows), for small M.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from milepost.kernels.fp8_decode import _tickets
from milepost.kernels.fp8_quant import TILE, _sm_count


class StreamConfig(NamedTuple):
    block_m: int  # rows of x per program (16 .. 128); more rows: a second grid axis
    block_n: int  # weight rows per unit (32, 64, 128: within one 128-row scale tile)
    block_k: int  # K per unit (128 for fp8: one scale block)
    swap: bool  # weight rows on the MMA's M side
    warps: int
    stages: int
    per_sm: int  # programs per SM (1 or 2)
    ticket: bool = True  # split tiles summed by their last piece (else a second kernel)


STAGE_BYTES = 160 << 10  # shared memory for the pipeline's stages (an H100/H200 SM has 227 KB)


def stream_config(m: int, n: int, k: int, fp8: bool) -> StreamConfig:
    """The rule until measured per shape (benchmarks/stream_decode_gpu.py): rows in one block up
    to 64 (swapped below 64: x's rows on the MMA's N side), 64-wide weight tiles, 128-wide K
    blocks where K allows, and as many stages (up to 6) as STAGE_BYTES holds: the weight bytes
    in flight per SM are what a memory-bound loop needs."""
    bm = max(16, min(64, triton.next_power_of_2(max(m, 1))))
    bn = 64 if n % 64 == 0 else 32
    bk = TILE if fp8 or k % TILE == 0 else 64
    stage = (bn + bm) * bk * (1 if fp8 else 2)
    return StreamConfig(bm, bn, bk, bm < 64, 4, max(2, min(6, STAGE_BYTES // stage)), 1)


@triton.jit
def _unit_product(X, SX, W, SW, rm, row_ok, t, kb, stride_x, stride_sxm, stride_sxk, stride_w,
                  stride_swn, stride_swk, acc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  FP8: tl.constexpr, SWAP: tl.constexpr):
    """acc + this unit's product: column tile t, K block kb (acc is [BLOCK_N, BLOCK_M] when SWAP)."""
    rn = t * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.load(W + rn[:, None].to(tl.int64) * stride_w + rk[None, :])  # N is whole tiles: no mask
    x = tl.load(X + rm[:, None].to(tl.int64) * stride_x + rk[None, :], mask=row_ok[:, None], other=0.0)
    if FP8:
        sw = tl.load(SW + (t * BLOCK_N // 128) * stride_swn + kb * stride_swk)
        sx = tl.load(SX + rm * stride_sxm + kb * stride_sxk, mask=row_ok, other=1.0)
        if SWAP:
            acc += tl.dot(w, tl.trans(x)) * (sx[None, :] * sw)
        else:
            acc += tl.dot(x, tl.trans(w)) * (sx[:, None] * sw)
    else:
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _store_tile(acc, DST, rm, row_ok, rn_local, stride_row, SWAP: tl.constexpr):
    """acc (a [BLOCK_M, BLOCK_N] tile, or its transpose when SWAP) into DST's rows rm."""
    if SWAP:
        ptrs = DST + rm[None, :].to(tl.int64) * stride_row + rn_local[:, None]
        tl.store(ptrs, acc.to(DST.dtype.element_ty), mask=row_ok[None, :])
    else:
        ptrs = DST + rm[:, None].to(tl.int64) * stride_row + rn_local[None, :]
        tl.store(ptrs, acc.to(DST.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _owner(u, n_units, n_prog):
    """The program whose units [p U / P, (p + 1) U / P) hold unit u."""
    return ((u + 1) * n_prog - 1) // n_units


@triton.jit
def _first_program(t, n_kb, n_units, n_prog):
    return _owner(t * n_kb, n_units, n_prog)


@triton.jit
def _last_program(t, n_kb, n_units, n_prog):
    return _owner((t + 1) * n_kb - 1, n_units, n_prog)


@triton.jit
def _sum_pieces(C, P, rm, row_ok, t, n_kb, n_units, n_prog, pid_m, stride_c,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """C's tile t = 0 + its pieces in K order (the programs that cover it: a program that starts
    inside the tile stored its piece in slot 0, one that started before it in slot 1)."""
    if SWAP:
        total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        offs = tl.arange(0, BLOCK_M)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    else:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for q in range(_first_program(t, n_kb, n_units, n_prog), _last_program(t, n_kb, n_units, n_prog) + 1):
        slot = tl.where(q * n_units // n_prog >= t * n_kb, 0, 1)
        base = ((pid_m * n_prog + q) * 2 + slot).to(tl.int64) * (BLOCK_M * BLOCK_N)
        total += tl.load(P + base + offs, cache_modifier=".cg")
    _store_tile(total, C + t * BLOCK_N, rm, row_ok, tl.arange(0, BLOCK_N), stride_c, SWAP)


@triton.jit
def _finish_split_tile(C, P, CNT, rm, row_ok, t, n_kb, n_units, n_prog, n_tiles, pid_m, stride_c,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """The ticket: the last program to store a piece of tile t sums the pieces."""
    pieces = _last_program(t, n_kb, n_units, n_prog) - _first_program(t, n_kb, n_units, n_prog) + 1
    tl.debug_barrier()  # every thread's piece is stored before the ticket (release) is taken
    cnt = CNT + pid_m * n_tiles + t
    ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if ticket == pieces - 1:
        _sum_pieces(C, P, rm, row_ok, t, n_kb, n_units, n_prog, pid_m, stride_c, BLOCK_M, BLOCK_N, SWAP)
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero for the next kernel


@triton.jit(do_not_specialize=["M", "n_kb", "n_units", "n_prog", "n_tiles", "stride_sxm",
                               "stride_sxk", "stride_swn", "stride_swk"])
def _stream_kernel(X, SX, W, SW, C, P, CNT, M, n_kb, n_units, n_prog, n_tiles, stride_x, stride_sxm,
                   stride_sxk, stride_w, stride_swn, stride_swk, stride_c,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   FP8: tl.constexpr, SWAP: tl.constexpr, TICKET: tl.constexpr,
                   STAGES: tl.constexpr):
    pid, pid_m = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < M
    start = pid * n_units // n_prog
    end = (pid + 1) * n_units // n_prog
    t_first = start // n_kb
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        local = tl.arange(0, BLOCK_M)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for u in tl.range(start, end, num_stages=STAGES):
        t = u // n_kb
        kb = u - t * n_kb
        acc = _unit_product(X, SX, W, SW, rm, row_ok, t, kb, stride_x, stride_sxm, stride_sxk,
                            stride_w, stride_swn, stride_swk, acc, BLOCK_N, BLOCK_K, FP8, SWAP)
        if (kb == n_kb - 1) | (u == end - 1):  # this tile's piece ends here
            if _first_program(t, n_kb, n_units, n_prog) == _last_program(t, n_kb, n_units, n_prog):  # whole: the output
                _store_tile(acc, C + t * BLOCK_N, rm, row_ok, tl.arange(0, BLOCK_N), stride_c, SWAP)
            else:  # a piece: this program's slot (0 for its first tile, 1 for its last)
                slot = tl.where(t == t_first, 0, 1)
                base = ((pid_m * n_prog + pid) * 2 + slot).to(tl.int64) * (BLOCK_M * BLOCK_N)
                tl.store(P + base + local, acc)
            acc = tl.zeros_like(acc)
    if TICKET:
        t_last = (end - 1) // n_kb
        if _first_program(t_first, n_kb, n_units, n_prog) != _last_program(t_first, n_kb, n_units, n_prog):
            _finish_split_tile(C, P, CNT, rm, row_ok, t_first, n_kb, n_units, n_prog, n_tiles, pid_m,
                               stride_c, BLOCK_M, BLOCK_N, SWAP)
        if t_last != t_first:
            if _first_program(t_last, n_kb, n_units, n_prog) != _last_program(t_last, n_kb, n_units, n_prog):
                _finish_split_tile(C, P, CNT, rm, row_ok, t_last, n_kb, n_units, n_prog, n_tiles, pid_m,
                                   stride_c, BLOCK_M, BLOCK_N, SWAP)


@triton.jit(do_not_specialize=["M", "n_kb", "n_units", "n_prog"])
def _sum_split_tiles_kernel(C, P, M, n_kb, n_units, n_prog, n_tiles, stride_c, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """The second kernel: one program per (tile, M block); tiles one program covered are done."""
    t, pid_m = tl.program_id(0), tl.program_id(1)
    if _first_program(t, n_kb, n_units, n_prog) != _last_program(t, n_kb, n_units, n_prog):
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        _sum_pieces(C, P, rm, rm < M, t, n_kb, n_units, n_prog, pid_m, stride_c, BLOCK_M, BLOCK_N, SWAP)


def stream_programs(units: int, sms: int, per_sm: int) -> int:
    """per_sm programs per SM, fewer when there are fewer units (none goes without)."""
    return max(1, min(units, sms * per_sm))


@functools.lru_cache(maxsize=1024)  # per shape: eager calls (small prefills) skip the loop
def splits_tiles(units: int, programs: int, n_kb: int) -> bool:
    """Whether a program's range starts inside a tile (that tile then has two or more pieces)."""
    return any(p * units // programs % n_kb for p in range(1, programs))


def stream_mm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, sx: torch.Tensor | None = None,
              sw: torch.Tensor | None = None, m: int | None = None,
              cfg: StreamConfig | None = None) -> torch.Tensor:
    """The first m rows (all by default) of x [>= m, K] times w [N, K] -> [m, N] out_dtype.
    fp8: x float8_e4m3fn with its 1 x 128 scales sx [>= m, K/128] (any strides), w float8_e4m3fn
    with 128 x 128 scales sw [N/128, K/128]; else x and w in one 16-bit dtype. N must be a
    multiple of cfg.block_n (and of 128 for fp8), K of cfg.block_k; x's rows contiguous."""
    fp8 = w.dtype == torch.float8_e4m3fn
    m = x.shape[0] if m is None else m
    n, k = w.shape
    cfg = cfg or stream_config(m, n, k, fp8)
    if fp8 and (sx is None or sw is None or cfg.block_k != TILE or n % TILE or k % TILE):
        raise ValueError(f"fp8 stream_mm needs both scales, block_k {TILE} and N, K multiples of "
                         f"{TILE} (got N={n}, K={k}, block_k={cfg.block_k})")
    if n % cfg.block_n or k % cfg.block_k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"stream_mm: N={n} must be a multiple of block_n {cfg.block_n}, K={k} of "
                         f"block_k {cfg.block_k}, and rows contiguous")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    n_tiles, n_kb = n // cfg.block_n, k // cfg.block_k
    n_units = n_tiles * n_kb
    n_prog = stream_programs(n_units, _sm_count(x.device), cfg.per_sm)
    m_blocks = triton.cdiv(m, cfg.block_m)
    split = splits_tiles(n_units, n_prog, n_kb)
    parts = torch.empty((m_blocks * n_prog * 2 * cfg.block_m * cfg.block_n,) if split else (1,),
                        dtype=torch.float32, device=x.device)
    ticket = cfg.ticket and split and m_blocks * n_tiles <= 1 << 16
    cnt = _tickets(x.device) if ticket else parts
    s_x = sx if fp8 else x
    s_w = sw if fp8 else w
    _stream_kernel[(n_prog, m_blocks)](
        x, s_x, w, s_w, out, parts, cnt, m, n_kb, n_units, n_prog, n_tiles, x.stride(0),
        s_x.stride(0) if fp8 else 0, s_x.stride(1) if fp8 else 0, w.stride(0),
        s_w.stride(0) if fp8 else 0, s_w.stride(1) if fp8 else 0, out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FP8=fp8, SWAP=cfg.swap,
        TICKET=ticket, STAGES=cfg.stages, num_warps=cfg.warps)
    if split and not ticket:
        _sum_split_tiles_kernel[(n_tiles, m_blocks)](
            out, parts, m, n_kb, n_units, n_prog, n_tiles, out.stride(0), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, SWAP=cfg.swap, num_warps=4)
    return out
