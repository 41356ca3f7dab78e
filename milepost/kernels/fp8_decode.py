"""The decode-M FP8 block GEMM (`decode_block_mm`): for the few to few hundred rows of a decode
step, where the fp8 weight's bytes dominate. Configs per (N, K, M bucket) come from the H200
measurements in milepost/lowprec/fp8_decode_table.py; milepost/kernels/fp8_gemm.py probes it and
picks it per M bucket where it is the fastest correct GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from milepost.kernels import fp8_quant
from milepost.kernels.fp8_quant import (
    TILE,
    _round_e4m3,
    _sm_count,
    gdc_wait,
    pdl_supported,
    quantize_act_1x128,
)
from milepost.kernels.fused_fp8_act import quantize_rows_fp8
from milepost.lowprec import fp8_decode_table
from milepost.lowprec.fp8_act import SplitSum

# At decode M (a few to a few hundred rows) the weight's bytes dominate: each program reads its
# fp8 weight tiles once, takes the activation rows quantized per 1x128 block by
# quantize_act_1x128 (or, `fused`, quantizes them itself with the same operations, so the same
# bits: measured slower, every weight block redoes it), and K is split over programs when N
# alone leaves SMs idle. The split parts (fp32) are summed in the order
# 0, 1, 2, ... either by a second kernel or, `ticket`, by whichever program of an output tile
# finishes last (an atomic counter only picks that program; no value is accumulated
# atomically): the same sums either way, never dependent on timing.


class DecodeConfig(NamedTuple):
    block_m: int  # rows per program (16, 32, 64, 128)
    block_n: int  # weight rows per program (32, 64, 128: within one 128-row scale tile; 256)
    split: int  # programs along K (1: no partial sums)
    warps: int
    stages: int  # software-pipelined loads
    fused: bool  # quantize the activations in the GEMM (else quantize_act_1x128 first)
    ticket: bool = False  # split parts summed by the tile's last program (else a second kernel)
    narrow: bool = False  # fused, M < block_m: quantize only M's power of two rows (repeated)
    pdl: bool = False  # launched while the kernel before it ends (programmatic dependent launch)


DECODE_BUCKETS = (1, 8, 16, 32, 64, 128, 256)  # M rounded up to one of these picks the config
# (N, K, M bucket) -> config, measured by benchmarks/fp8_gemm_sweep.py on the H200
# (milepost/lowprec/fp8_decode_table.py); a (N, K) not listed gets decode_config's rule.
DECODE_TABLE: dict[tuple[int, int, int], DecodeConfig] = {
    key: DecodeConfig(*cfg) for key, cfg in fp8_decode_table.H200.items()}
_TICKETS: dict[int, torch.Tensor] = {}  # device -> int32 counters, zero between kernels
_FAILED: dict[int, set[str]] = {}  # device -> options ("ticket", "narrow") that failed the probe
_TICKET_SLOTS = 1 << 16
# How split parts are summed, over every config: None keeps each config's `ticket`; True sums by
# ticket, False by the second kernel (the same bits either way: an A/B switch for whole-engine
# runs, read when a launch is made, so at CUDA-graph capture). The table's M = 64 configs were
# timed on the H200 with the quantize as its own launch, where the second kernel was no slower;
# on the H100 that kernel is 2.3 us a call, 108 calls a 4B decode step (issue 23).
TICKET: bool | None = None
# The separate activation quantize (o_proj's input, made by the attention kernel) by
# fused_fp8_act.quantize_rows_fp8 (8 blocks a program, the same bits) instead of
# quantize_act_1x128 (one block a program); not with programmatic dependent launch. On an H100
# (benchmarks/fp8_act_sweep.py, 2026-12-06) 2.31 vs 2.71 us at 64 rows of the 4B, 3.57 vs 6.65
# at 256, 2.10 vs 2.11 / 2.63 vs 3.99 on the 0.6B.
QUANT_ROWS = True
# Under programmatic dependent launch (fp8_quant.PDL), whether the GEMM asks L2 for its weight
# rows before it waits (an A/B switch: on an H100 the early launch ran the 4B FP8 engine x0.845
# with the prefetch, x0.975 without, so fp8_quant.PDL stays off).
PDL_PREFETCH = True


def decode_config(m: int, n: int, k: int, sms: int) -> DecodeConfig:
    """The table's config for this M bucket, else: the smallest row block that holds M (64 at
    most), 64-wide weight blocks, K split until about two programs per SM stream a part, the
    activations quantized by their own kernel (the fused quantization measured 2-4x slower on
    the H200 at every shape and M swept: it is redone by every weight block)."""
    bucket = next((b for b in DECODE_BUCKETS if m <= b), DECODE_BUCKETS[-1])
    cfg = DECODE_TABLE.get((n, k, bucket))
    if cfg is not None:
        return cfg
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn = 64 if n % 64 == 0 else 32
    tiles = max(1, triton.cdiv(m, bm) * (n // bn))
    split = max(1, min(k // TILE // 4, 2 * sms // tiles))
    return DecodeConfig(bm, bn, split, 4, 3, False)


@triton.jit
def _prefetch_l2(rows, nbytes):
    """Bring nbytes (a multiple of 16) from each 16-byte aligned address in `rows` into L2 (one
    bulk prefetch a row; nothing waits for it)."""
    size = nbytes + tl.zeros(rows.shape, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [rows, size], dtype=tl.int32, is_pure=False, pack=1)


# Only the row strides (multiples of 16: vectorized loads) are specialized: one compiled kernel
# serves every M and shape.
@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_sxk", "stride_swn", "stride_swk",
                               "stride_ps", "n_kb", "kb_per", "split"])
def _decode_kernel(X, SX, W, SW, C, P, CNT, M, stride_x, stride_sxm, stride_sxk, stride_w,
                   stride_swn, stride_swk, stride_c, stride_ps, n_kb, kb_per, split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED: tl.constexpr,
                   MODE: tl.constexpr, QROWS: tl.constexpr, PDL: tl.constexpr = False,
                   PREFETCH: tl.constexpr = True):
    """Over this program's K blocks, sum Q(X) Q(W)^T per block scaled by both scales. FUSED: X is
    the bf16/fp16/fp32 activation, quantized here (QROWS rows of it, repeated to BLOCK_M: the
    rows past M are never stored); else fp8 with scales SX. MODE 0: the sum is the output C;
    1: it is part pid_k of P; 2: also, the tile's last program sums P into C. PDL: launched
    before the kernel writing X ended: this program's weight rows are sent to L2 (PREFETCH; they
    do not depend on it), then it waits for that kernel before any other load."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL and PREFETCH:
        k_first = pid_k * kb_per
        k_end = tl.minimum(k_first + kb_per, n_kb)
        _prefetch_l2(W + rn.to(tl.int64) * stride_w + k_first * 128, (k_end - k_first) * 128)
    if PDL:
        gdc_wait()
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, 128)
    row_ok = rm < M
    x_ptr = X + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    rq = pid_m * BLOCK_M + tl.arange(0, QROWS)
    q_ptr = X + rq[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    if BLOCK_N <= 128:  # one weight scale per K block
        sw_ptr = SW + (pid_n * BLOCK_N // 128) * stride_swn
    else:  # one per column (two 128-row tiles)
        sw_ptr = SW + (rn // 128) * stride_swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = pid_k * kb_per
    for kb in range(k0, tl.minimum(k0 + kb_per, n_kb)):
        w = tl.load(w_ptr + kb * 128)  # N is a multiple of BLOCK_N: no mask
        sw = tl.load(sw_ptr + kb * stride_swk)
        if FUSED:  # _quant_act_kernel's operations, per row of the block
            x = tl.load(q_ptr + kb * 128, mask=(rq < M)[:, None], other=0.0).to(tl.float32)
            finite = tl.abs(x) < float("inf")  # False for NaN and +-Inf
            amax = tl.max(tl.where(finite, tl.abs(x), 0.0), 1)
            bad = tl.min(finite.to(tl.int32), 1) == 0
            sx = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
            sx = tl.where(bad, float("nan"), sx)
            xq = _round_e4m3(tl.math.div_rn(x, sx[:, None])).to(tl.float8e4nv)
            if QROWS < BLOCK_M:  # row i of the block is row i % QROWS
                xq = tl.reshape(tl.broadcast_to(xq[None, :, :], (BLOCK_M // QROWS, QROWS, 128)),
                                (BLOCK_M, 128))
                sx = tl.reshape(tl.broadcast_to(sx[None, :], (BLOCK_M // QROWS, QROWS)), (BLOCK_M,))
        else:
            xq = tl.load(x_ptr + kb * 128, mask=row_ok[:, None], other=0.0)
            sx = tl.load(SX + rm * stride_sxm + kb * stride_sxk, mask=row_ok, other=1.0)
        if BLOCK_N <= 128:
            acc += tl.dot(xq, tl.trans(w)) * (sx[:, None] * sw)
        else:
            acc += tl.dot(xq, tl.trans(w)) * (sx[:, None] * sw[None, :])
    offs = rm[:, None].to(tl.int64) * stride_c + rn[None, :]
    if MODE == 0:
        tl.store(C + offs, acc.to(C.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(P + pid_k * stride_ps + offs, acc, mask=row_ok[:, None])
        if MODE == 2:
            tl.debug_barrier()  # every thread's part is stored before the ticket (release) is taken
            cnt = CNT + pid_m * tl.num_programs(1) + pid_n
            ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if ticket == split - 1:  # the last program of this tile: the parts in order 0, 1, ...
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, split):
                    total += tl.load(P + s * stride_ps + offs, mask=row_ok[:, None], other=0.0,
                                     cache_modifier=".cg")
                tl.store(C + offs, total.to(C.dtype.element_ty), mask=row_ok[:, None])
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero for the next kernel


@triton.jit
def _sum_parts_kernel(P, C, size, split, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """C = 0 + P[0] + P[1] + ... in that order (fp32; the ticket's sums), cast to C's dtype."""
    if PDL:
        gdc_wait()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, split):
        acc += tl.load(P + s * size + offs, mask=ok, other=0.0)
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=ok)


def sum_split_parts(parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = 0 + parts[0] + parts[1] + ... in that order (fp32 [split, ...] parts, contiguous),
    cast to out's dtype, in one launch: the split-K GEMMs' fixed-order reduction."""
    size = out.numel()
    _sum_parts_kernel[(triton.cdiv(size, 1024),)](parts, out, size, parts.shape[0], BLOCK=1024)
    return out


def _tickets(device: torch.device) -> torch.Tensor:
    """Zeroed counters for the ticket sums, one set per device: kernels of one stream run one
    after another, and each counter is back at zero when its kernel ends."""
    idx = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    if idx not in _TICKETS:
        _TICKETS[idx] = torch.zeros(_TICKET_SLOTS, dtype=torch.int32, device=device)
    return _TICKETS[idx]


def decode_block_mm(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype,
                    cfg: DecodeConfig | None = None, unsummed: bool = False
                    ) -> torch.Tensor | SplitSum:
    """x [M, K] (bf16/fp16/fp32, contiguous rows) times fp8 w [N, K] with 128x128 scales sw
    [N/128, K/128] -> [M, N] out_dtype; N a multiple of 128. The activation values are
    quantize_act_1x128's (fused or not, per `cfg`; decode_config's when None). `unsummed`: a
    split-K product summed by the second kernel comes back as its parts (lowprec/fp8_act.py)."""
    m, k = x.shape
    cfg = _shaped(cfg or decode_config(m, w.shape[0], k, _sm_count(x.device)), w)
    if cfg.fused:
        return _launch(x, x, (0, 0), m, w, sw, out_dtype, cfg, unsummed)
    if QUANT_ROWS and not _pdl(cfg, x):
        a = quantize_rows_fp8(x)
        return _launch(a.values, a.scales, (a.scales.stride(0), a.scales.stride(1)), m, w, sw,
                       out_dtype, cfg, unsummed)
    xa, sx = quantize_act_1x128(x, pdl=_pdl(cfg, x))
    return _launch(xa, sx, (sx.stride(0), sx.stride(1)), m, w, sw, out_dtype, cfg, unsummed)


def decode_block_mm_quantized(xq: torch.Tensor, sx: torch.Tensor, m: int, w: torch.Tensor,
                              sw: torch.Tensor, out_dtype: torch.dtype,
                              cfg: DecodeConfig | None = None, unsummed: bool = False
                              ) -> torch.Tensor | SplitSum:
    """decode_block_mm of an activation already quantized: xq [>= m, K] fp8 with its 1x128
    scales sx [>= m, K/128] (any strides; quantize_act_1x128's bits, made by the kernel that
    made the activation: kernels/fused_fp8_act.py) -> [m, N]. The config's own quantization is
    dropped (the values are the same bits); the rest of it is the table's for this M."""
    cfg = _shaped(cfg or decode_config(m, w.shape[0], xq.shape[1], _sm_count(xq.device)), w)
    return _launch(xq, sx, (sx.stride(0), sx.stride(1)), m, w, sw, out_dtype,
                   cfg._replace(fused=False), unsummed)


def _shaped(cfg: DecodeConfig, w: torch.Tensor) -> DecodeConfig:
    """256-wide weight blocks need N a multiple of 256: 128 otherwise."""
    return cfg._replace(block_n=TILE) if w.shape[0] % cfg.block_n else cfg


def _pdl(cfg: DecodeConfig, x: torch.Tensor) -> bool:
    """Launched early (fp8_quant.PDL: every config's switch, else the config's own)."""
    on = cfg.pdl if fp8_quant.PDL is None else fp8_quant.PDL
    return on and pdl_supported(x.device)


def _launch(xa: torch.Tensor, sx: torch.Tensor, s_strides: tuple[int, int], m: int, w: torch.Tensor,
            sw: torch.Tensor, out_dtype: torch.dtype, cfg: DecodeConfig, unsummed: bool = False
            ) -> torch.Tensor | SplitSum:
    """The GEMM kernel (and the parts' sum, unless `unsummed`: then the parts) over the first m
    rows of xa: bf16 quantized inside (cfg.fused), else fp8 with scales sx."""
    n, n_kb = w.shape[0], xa.shape[1] // TILE
    pdl = _pdl(cfg, xa)
    kb_per = triton.cdiv(n_kb, cfg.split)
    split = triton.cdiv(n_kb, kb_per)  # no program without K blocks
    grid = (triton.cdiv(m, cfg.block_m), n // cfg.block_n, split)
    out = torch.empty((m, n), dtype=out_dtype, device=xa.device)
    if m == 0:
        return out
    failed = _FAILED.get(xa.device.index or 0, set())
    ticket = (cfg.ticket if TICKET is None else TICKET) and grid[0] * grid[1] <= _TICKET_SLOTS \
        and "ticket" not in failed
    mode = 0 if split == 1 else (2 if ticket else 1)
    narrow = cfg.fused and cfg.narrow and m < cfg.block_m and "narrow" not in failed
    qrows = triton.next_power_of_2(m) if narrow else cfg.block_m
    part = out if mode == 0 else torch.empty((split, m, n), dtype=torch.float32, device=xa.device)
    cnt = _tickets(xa.device) if mode == 2 else part
    _decode_kernel[grid](xa, sx, w, sw, out, part, cnt, m, xa.stride(0), *s_strides, w.stride(0),
                         sw.stride(0), sw.stride(1), n, m * n, n_kb, kb_per, split,
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, FUSED=cfg.fused, MODE=mode,
                         QROWS=qrows, num_warps=cfg.warps, num_stages=cfg.stages,
                         **({"PDL": True, "PREFETCH": PDL_PREFETCH, "launch_pdl": True} if pdl else {}))
    if mode == 1 and unsummed and not pdl:
        return SplitSum(part, out_dtype)
    if mode == 1:
        _sum_parts_kernel[(triton.cdiv(m * n, 1024),)](
            part, out, m * n, split, BLOCK=1024, **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return out
