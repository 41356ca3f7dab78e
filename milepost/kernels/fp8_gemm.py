"""FP8 blockwise GEMM on Hopper: y = Q(x) @ Q(W)^T with 1x128 activation and 128x128 weight scales.

`quantize_act_1x128` is one Triton kernel that gives bit-for-bit what milepost.lowprec.quantize
gives (scale = amax / 448 with IEEE division, round-to-nearest-even saturating E4M3, a block with
NaN/Inf gets a NaN scale): the engine's and the trainer's activations stay in the contract.
The GEMM is cuBLAS's block-scaled FP8 GEMM through `torch._scaled_mm` (M-major 1x128 scales, M
padded to a multiple of 4; K/128 a multiple of 4, see `cublas_takes`) where a probe on operands
whose scales differ by orders of magnitude gives the emulated product, else a Triton kernel
(DeepSeek-V3's recipe: per 128-wide K step, an FP8 tensor-core product scaled by both blocks'
scales, accumulated in fp32), else emulated with a warning. At decode batch sizes (M <=
DECODE_M) a third, `decode_block_mm`, fuses the activation quantization into a split-K FP8 GEMM
with configs measured per shape (DECODE_TABLE); per M bucket the fastest correct GEMM is used,
timed once from CUDA graphs.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from milepost.lowprec import fp8_decode_table

try:  # programmatic dependent launch (Hopper): a kernel starts while the one before it finishes
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # this Triton has no grid dependency control: configs asking for it run without
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():  # never called: PDL stays off
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

log = logging.getLogger(__name__)
TILE = 128
_BACKEND: dict[int, str] = {}  # device -> GEMM for any M
_SMALL: dict[int, dict[int, str]] = {}  # device -> M bucket (<= DECODE_M) -> GEMM
_ROWS: dict[int, str] = {}  # device -> weight-gradient GEMM (both operands 1x128 along tokens)
DECODE_M = 256


@triton.jit
def _round_e4m3(y):
    """y rounded to E4M3 (ties to even, saturating at 448, sign of zero kept, NaN kept) as an
    exactly representable float32, so the final cast has nothing left to round."""
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # floor(log2 a)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3 mantissa bits)
    v = a / step  # a power of two: exact
    r = (v + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 addition rounds to even here
    q = tl.minimum(r * step, 448.0)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    q = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, q)  # noqa: PLR0124 - NaN stays NaN


@triton.jit
def _quant_act_kernel(X, Q, S, stride_x, stride_q, stride_sm, stride_sk, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    if PDL:  # launched before the kernel writing X ended: wait for it; the GEMM reading Q may
        gdc_launch_dependents()  # launch now (it waits for this kernel's end before reading)
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols).to(tl.float32)
    finite = tl.abs(x) < float("inf")  # False for NaN and +-Inf
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), 0)
    bad = tl.min(finite.to(tl.int32), 0) == 0
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    scale = tl.where(bad, float("nan"), scale)
    y = tl.math.div_rn(x, scale)
    tl.store(Q + row * stride_q + cols, _round_e4m3(y).to(tl.float8e4nv))
    tl.store(S + row * stride_sm + g * stride_sk, scale)


def quantize_act_1x128(x: torch.Tensor, pad_rows: int = 1,
                       pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (K % 128 == 0) -> (float8_e4m3fn [Mp, K], float32 scales [Mp, K/128]) with Mp =
    M rounded up to `pad_rows` (padding rows: zeros, scale 1). The scales are stored M-major
    (stride (1, Mp)): the layout cuBLAS's 1x128 block scaling reads."""
    m, k = x.shape
    mp = -(-m // pad_rows) * pad_rows
    q = torch.empty((mp, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((k // TILE, mp), dtype=torch.float32, device=x.device).t()
    if mp > m:
        q[m:].view(torch.uint8).zero_()
        s[m:] = 1.0
    if m:
        _quant_act_kernel[(m, k // TILE)](x, q, s, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                          BLOCK=TILE, **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return q, s


@triton.jit
def _gemm_kernel(A, SA, B, SB, C, M, N, K, stride_a, stride_b, stride_c, stride_cs, stride_sam,
                 stride_sak, stride_sbn, stride_sbk, n_kb, kb_per, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_ROWS: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k * kb_per, tl.minimum(pid_k * kb_per + kb_per, n_kb)):
        a = tl.load(A + rm[:, None] * stride_a + (kb * BLOCK_K + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(B + rn[:, None] * stride_b + (kb * BLOCK_K + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        sa = tl.load(SA + rm * stride_sam + kb * stride_sak, mask=rm < M, other=0.0)
        if B_ROWS:  # B quantized 1x128 per row too (the weight-gradient GEMM)
            sb = tl.load(SB + rn * stride_sbn + kb * stride_sbk, mask=rn < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        else:  # B in 128x128 tiles: BLOCK_N divides 128, so one scale per (N tile, K block)
            sb = tl.load(SB + (pid_n * BLOCK_N // 128) * stride_sbn + kb * stride_sbk)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
    tl.store(C + pid_k * stride_cs + rm[:, None] * stride_c + rn[None, :],
             acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def triton_block_mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype, b_rows: bool = False) -> torch.Tensor:
    """xq [M, K] fp8, sx [M, K/128]; w [N, K] fp8, sw [N/128, K/128] (b_rows: [N, K/128], w
    quantized 1x128 per row) -> [M, N] out_dtype. Scales may have any strides."""
    m, k = xq.shape
    n, n_kb = w.shape[0], k // TILE
    # Small M (decode) reads the weight once: narrow N blocks, and the K blocks split over
    # programs until every SM streams a part of the weight; the parts' fp32 sums are added in
    # a fixed order (deterministic, unlike atomics).
    bm, bn = (16, 32) if m <= 16 else ((64, 64) if m <= 64 else (128, 128))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = min(n_kb, max(1, 2 * _sm_count(xq.device) // tiles)) if m <= 64 else 1
    kb_per = triton.cdiv(n_kb, split)
    split = triton.cdiv(n_kb, kb_per)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _gemm_kernel[grid](xq, sx, w, sw, part, m, n, k, xq.stride(0), w.stride(0), n, m * n,
                       sx.stride(0), sx.stride(1), sw.stride(0), sw.stride(1), n_kb, kb_per,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=TILE, B_ROWS=b_rows)
    return out if split == 1 else part.sum(0).to(out_dtype)


# --- Decode-M GEMM: activation quantization fused into the FP8 GEMM ---------------------------
# At decode M (a few to a few hundred rows) the weight's bytes dominate: one kernel reads each
# fp8 weight tile once per program, quantizes the program's activation rows per 1x128 block
# itself (the same operations as _quant_act_kernel, so the same bits), and splits K over
# programs when N alone leaves SMs idle. The split parts (fp32) are summed in the order
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


# Only the row strides (multiples of 16: vectorized loads) are specialized: one compiled kernel
# serves every M and shape.
@triton.jit(do_not_specialize=["M", "stride_sxm", "stride_sxk", "stride_swn", "stride_swk",
                               "stride_ps", "n_kb", "kb_per", "split"])
def _decode_kernel(X, SX, W, SW, C, P, CNT, M, stride_x, stride_sxm, stride_sxk, stride_w,
                   stride_swn, stride_swk, stride_c, stride_ps, n_kb, kb_per, split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FUSED: tl.constexpr,
                   MODE: tl.constexpr, QROWS: tl.constexpr, PDL: tl.constexpr = False):
    """Over this program's K blocks, sum Q(X) Q(W)^T per block scaled by both scales. FUSED: X is
    the bf16/fp16/fp32 activation, quantized here (QROWS rows of it, repeated to BLOCK_M: the
    rows past M are never stored); else fp8 with scales SX. MODE 0: the sum is the output C;
    1: it is part pid_k of P; 2: also, the tile's last program sums P into C. PDL: launched
    before the kernel writing X ended: wait for it before any load."""
    if PDL:
        gdc_wait()
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
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


def _tickets(device: torch.device) -> torch.Tensor:
    """Zeroed counters for the ticket sums, one set per device: kernels of one stream run one
    after another, and each counter is back at zero when its kernel ends."""
    idx = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    if idx not in _TICKETS:
        _TICKETS[idx] = torch.zeros(_TICKET_SLOTS, dtype=torch.int32, device=device)
    return _TICKETS[idx]


def decode_block_mm(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype,
                    cfg: DecodeConfig | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, contiguous rows) times fp8 w [N, K] with 128x128 scales sw
    [N/128, K/128] -> [M, N] out_dtype; N a multiple of 128. The activation values are
    quantize_act_1x128's (fused or not, per `cfg`; decode_config's when None)."""
    m, k = x.shape
    n, n_kb = w.shape[0], k // TILE
    cfg = cfg or decode_config(m, n, k, _sm_count(x.device))
    if n % cfg.block_n:  # 256-wide blocks need N a multiple of 256
        cfg = cfg._replace(block_n=TILE)
    pdl = cfg.pdl and _HAS_GDC and x.device.type == "cuda"
    if cfg.fused:
        xa, sx, s_strides = x, x, (0, 0)
    else:
        xa, sx = quantize_act_1x128(x, pdl=pdl)
        s_strides = (sx.stride(0), sx.stride(1))
    kb_per = triton.cdiv(n_kb, cfg.split)
    split = triton.cdiv(n_kb, kb_per)  # no program without K blocks
    grid = (triton.cdiv(m, cfg.block_m), n // cfg.block_n, split)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    failed = _FAILED.get(x.device.index or 0, set())
    ticket = cfg.ticket and grid[0] * grid[1] <= _TICKET_SLOTS and "ticket" not in failed
    mode = 0 if split == 1 else (2 if ticket else 1)
    narrow = cfg.fused and cfg.narrow and m < cfg.block_m and "narrow" not in failed
    qrows = triton.next_power_of_2(m) if narrow else cfg.block_m
    part = out if mode == 0 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    cnt = _tickets(x.device) if mode == 2 else part
    _decode_kernel[grid](xa, sx, w, sw, out, part, cnt, m, xa.stride(0), *s_strides, w.stride(0),
                         sw.stride(0), sw.stride(1), n, m * n, n_kb, kb_per, split,
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, FUSED=cfg.fused, MODE=mode,
                         QROWS=qrows, num_warps=cfg.warps, num_stages=cfg.stages,
                         **({"PDL": True, "launch_pdl": True} if pdl else {}))
    if mode == 1:
        _sum_parts_kernel[(triton.cdiv(m * n, 1024),)](
            part, out, m * n, split, BLOCK=1024, **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return out

def cublas_takes(k: int) -> bool:
    """Whether cuBLAS's block-scaled GEMM gives the right product for contraction dim k. It
    reads the 128x128 weight scales with a 16-byte aligned leading dimension, which torch
    2.11's _scaled_mm cannot express: K/128 must be a multiple of 4 (measured on the H200:
    K = 640 gave a wrong product, K = 512 the right one; every Qwen3 K qualifies)."""
    return k % TILE == 0 and (k // TILE) % 4 == 0


_FALLBACK: dict[int, str] = {}  # device -> GEMM for the K that cuBLAS does not take


def scaled_mm_block(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's FP8 GEMM with 1x128 x 128x128 block scaling through torch._scaled_mm (xq [M, K],
    w [N, K] fp8). The 1x128 scales are M-major with M padded to a multiple of 4 (cuBLAS
    refuses M = 1 and 2: their leading dimension must be 16-byte aligned); the weight scales
    K-major. A K that cuBLAS does not take (cublas_takes) goes to the fallback GEMM."""
    m, k = xq.shape
    if not cublas_takes(k):
        fallback = _FALLBACK.get(xq.device.index or 0, "emulated")
        return {"triton": triton_block_mm, "emulated": emulated_block_mm}[fallback](
            xq, sx, w, sw, out_dtype)
    if m % 4 or sx.stride(0) != 1:
        mp = -(-m // 4) * 4
        xq2 = torch.zeros((mp, k), dtype=torch.uint8, device=xq.device)
        xq2[:m] = xq.view(torch.uint8)
        s2 = torch.ones((sx.shape[1], mp), dtype=torch.float32, device=xq.device)
        s2[:, :m] = sx.t()
        xq, sx = xq2.view(torch.float8_e4m3fn), s2.t()
    out = torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=sw.contiguous().t(), out_dtype=out_dtype)
    return out[:m]


def rows_mm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor,
            out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """aq [M, T] x bq [N, T]^T with both quantized 1x128 along T (the weight-gradient GEMM;
    scales [M, T/128], [N, T/128]). scaled_mm needs T/128 a multiple of 4 and M-major scales."""
    if backend == "scaled_mm":
        return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)
    if backend == "triton":
        return triton_block_mm(aq, sa, bq, sb, out_dtype, b_rows=True)
    return ((aq.float() * sa.repeat_interleave(TILE, 1))
            @ (bq.float() * sb.repeat_interleave(TILE, 1)).t()).to(out_dtype)


def _probe_rows(device: torch.device) -> str:
    """The first of cuBLAS, Triton that gives the emulated weight-gradient product."""
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(256, 1024, device=device, generator=gen) * torch.logspace(-2, 2, 256, device=device)[:, None]
    b = torch.randn(384, 1024, device=device, generator=gen) * torch.logspace(2, -2, 384, device=device)[:, None]
    (aq, sa), (bq, sb) = quantize_act_1x128(a), quantize_act_1x128(b)
    ref = rows_mm(aq, sa, bq, sb, torch.float32, "emulated")
    for name in ("scaled_mm", "triton"):
        try:
            out = rows_mm(aq, sa, bq, sb, torch.bfloat16, name).float()
            torch.cuda.synchronize(device)
            if _agrees(out, ref):
                return name
            log.warning("fp8 weight-gradient GEMM %s: wrong product (max diff %.3g); not used",
                        name, (out - ref).abs().max().item())
        except Exception as e:  # noqa: BLE001 - unsupported here
            log.warning("fp8 weight-gradient GEMM %s not used: %s", name, str(e).splitlines()[0][:200])
    return "emulated"


def emulated_block_mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    x = xq.float() * sx.repeat_interleave(TILE, 1)
    wd = w.float() * sw.repeat_interleave(TILE, 0)[: w.shape[0]].repeat_interleave(TILE, 1)
    return (x @ wd.t()).to(out_dtype)


def _probe_cases(device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Operands whose scales differ by orders of magnitude per row, K block and weight tile (a
    scale read from the wrong place shows), at the M a decode and a prefill give:
    (xq, sx, w, sw, x) with x the bf16 activation that xq, sx quantize."""
    from milepost.lowprec.quantize import quantize

    gen = torch.Generator(device=device).manual_seed(0)
    cases = []
    for m, n, k in ((1, 384, 512), (3, 256, 640), (64, 384, 512), (200, 384, 512), (300, 256, 1024)):
        x = torch.randn(m, k, device=device, generator=gen)
        x = x * torch.logspace(-2, 2, m, device=device)[:, None]
        x = x * torch.logspace(-1, 1, k // TILE, device=device).repeat_interleave(TILE)[None, :]
        w = torch.randn(n, k, device=device, generator=gen) * 0.05
        w = w * torch.logspace(-1, 1, -(-n // TILE), device=device).repeat_interleave(TILE)[:n, None]
        qw = quantize(w, "fp8_block")
        xb = x.to(torch.bfloat16)
        xq, sx = quantize_act_1x128(xb)
        cases.append((xq, sx, qw.values, qw.scales, xb))
    return cases


def _agrees(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """bf16 output vs the fp32 emulated product: per-row tolerance (rows differ in scale)."""
    tol = 1e-2 * ref.abs() + 1e-2 * ref.abs().amax(1, keepdim=True) + 1e-30
    return bool(torch.isfinite(out).all() and ((out - ref).abs() <= tol).all())


def _decode_variants(m: int, n: int, k: int, sms: int, option: str = "") -> list[DecodeConfig]:
    """decode_config's choice and its opposite in fusion, wide and narrow blocks, an uneven K
    split; or (option) the parts summed by ticket, the narrow quantization: the code paths the
    table's configs take."""
    cfg = decode_config(m, n, k, sms)._replace(ticket=False, narrow=False)
    if option == "ticket":
        return [cfg._replace(split=3, ticket=True), cfg._replace(split=2, ticket=True, fused=not cfg.fused)]
    if option == "narrow":
        return [cfg._replace(fused=True, narrow=True), cfg._replace(fused=True, narrow=True, block_m=32)]
    return [cfg, cfg._replace(block_n=128, split=3, stages=3, fused=not cfg.fused),
            cfg._replace(block_n=32, split=1, stages=2),
            cfg._replace(block_m=64, block_n=256, split=2, warps=8, stages=3)]


def _run_case(name: str, case: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    xq, sx, w, sw, x = case
    if name.startswith("decode"):
        m, k = x.shape
        return [decode_block_mm(x, w, sw, torch.bfloat16, c) for c in _decode_variants(
            m, w.shape[0], k, _sm_count(x.device), name[7:])]
    return [(triton_block_mm if name == "triton" else scaled_mm_block)(xq, sx, w, sw, torch.bfloat16)]


def _probe(device: torch.device) -> list[str]:
    """The GEMMs that give the emulated product on every probe case (cuBLAS first, the decode
    kernel last: it serves only decode M), warning for each one that does not."""
    cases = _probe_cases(device)
    refs = [emulated_block_mm(*c[:4], torch.float32) for c in cases]
    ok: list[str] = []
    for name in ("triton", "scaled_mm", "decode", "decode_ticket", "decode_narrow"):
        if name == "scaled_mm":  # the K cuBLAS does not take go to the checked fallback
            _FALLBACK[device.index or 0] = "triton" if ok else "emulated"
        try:
            for c, ref in zip(cases, refs):
                for out in _run_case(name, c):
                    torch.cuda.synchronize(device)
                    if not _agrees(out.float(), ref):
                        raise ValueError(f"wrong product at M={c[0].shape[0]}, N={c[2].shape[0]}, "
                                         f"K={c[0].shape[1]} (max diff "
                                         f"{(out.float() - ref).abs().max().item():.3g})")
            ok.append(name)
        except Exception as e:  # noqa: BLE001 - unsupported by this torch/cuBLAS/Triton, or wrong
            log.warning("fp8 blockwise GEMM %s not used: %s", name, str(e).splitlines()[0][:200])
    # An option that failed is dropped from every config (parts summed by the second kernel,
    # all rows quantized), not the decode kernel.
    _FAILED[device.index or 0] = {o for o in ("ticket", "narrow") if f"decode_{o}" not in ok}
    ok = [n for n in ok if n in ("triton", "scaled_mm", "decode")]
    return sorted(ok, key=lambda n: (n != "scaled_mm", n == "decode"))


def _replay_ms(fn, device: torch.device, reps: int = 20) -> float:
    """Milliseconds per call of `fn` replayed from a CUDA graph, as the engine's decode runs it
    (eager when it cannot be captured): launch costs are not what is compared."""
    fn()
    torch.cuda.synchronize(device)
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 - time it eagerly then
        log.info("fp8 GEMM timing without a CUDA graph: %s", str(e).splitlines()[0][:120])
    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps


def _faster_at_decode(device: torch.device, names: list[str]) -> dict[int, str]:
    """Per decode M bucket, the fastest of the correct GEMMs on four 4096 x 4096 weights in
    turn (64 MB: more than L2 holds, as a model's layers are)."""
    ws = [torch.randn(4096, 4096, device=device).to(torch.float8_e4m3fn) for _ in range(4)]
    sw = torch.full((32, 32), 1e-3, device=device)
    best = {}
    for m in DECODE_BUCKETS:
        x = torch.randn(m, 4096, device=device, dtype=torch.bfloat16)
        ms = {n: _replay_ms(lambda n=n: [fp8_block_linear(x, w, sw, n) for w in ws], device)
              for n in names}
        log.info("fp8 blockwise GEMM at M=%d: %s", m,
                 ", ".join(f"{n} {t * 1e3 / len(ws):.1f} us" for n, t in ms.items()))
        best[m] = min(ms, key=ms.__getitem__)
    return best


def block_backend(device: torch.device, m: int | None = None) -> str:
    """'scaled_mm' | 'triton' | 'decode' | 'emulated' for this CUDA device, and for `m` rows
    when given (at most DECODE_M: the fastest correct one for m's bucket). Probed once, on
    operands that show a wrong scale layout; a fallback from cuBLAS is announced with a warning."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _BACKEND:
        dev = torch.device("cuda", idx)
        ok = _probe(dev) or ["emulated"]
        small = _faster_at_decode(dev, ok) if len(ok) > 1 else dict.fromkeys(DECODE_BUCKETS, ok[0])
        _BACKEND[idx], _SMALL[idx] = ok[0], small
        _ROWS[idx] = _probe_rows(dev) if ok[0] != "emulated" else "emulated"
        level = logging.INFO if ok[0] == "scaled_mm" else logging.WARNING
        log.log(level, "fp8 blockwise GEMM on cuda:%d: %s (decode M buckets: %s; weight gradient: %s)%s",
                idx, ok[0], small, _ROWS[idx],
                "" if ok[0] != "emulated" else "; dequantized bf16 GEMMs: slow")
    if m is not None and m <= DECODE_M:
        return _SMALL[idx][next(b for b in DECODE_BUCKETS if m <= b)]
    return _BACKEND[idx]


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                     backend: str | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) times fp8 weight w [N, K] with 128x128 scales sw."""
    shape = x.shape
    m = x.numel() // shape[-1]
    backend = backend or block_backend(x.device, m)
    x2 = x.reshape(-1, shape[-1]).contiguous()
    if backend == "decode" and w.shape[0] % TILE == 0:
        return decode_block_mm(x2, w, sw, x.dtype).reshape(*shape[:-1], w.shape[0])
    if backend == "decode":  # N not whole tiles: the GEMM for any M
        backend = block_backend(x.device)
    pad = 4 if backend == "scaled_mm" else 1
    xq, sx = quantize_act_1x128(x2, pad)
    fn = {"scaled_mm": scaled_mm_block, "triton": triton_block_mm,
          "emulated": emulated_block_mm}[backend]
    return fn(xq, sx, w, sw, x.dtype)[:m].reshape(*shape[:-1], w.shape[0])


class Fp8BlockLinearFn(torch.autograd.Function):
    """The trainer's FP8 linear on Hopper: the three GEMMs in FP8 with the values the emulated
    path (milepost/lowprec/linear.py) uses: forward x (1x128) x W (128x128); data gradient
    gy (1x128 along N) x W^T (the same tiles transposed); weight gradient gy^T x x^T, both
    1x128 along the tokens (zero-padded to a multiple of 128). The weight's gradient goes
    straight through to the master weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wv: torch.Tensor,
                ws: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, wv, ws)
        return fp8_block_linear(x, wv, ws)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x, wv, ws = ctx.saved_tensors
        x2, gy2 = x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1]).contiguous()
        gx = fp8_block_linear(gy2, wv.t().contiguous(), ws.t().contiguous())
        block_backend(x.device)
        rows = _ROWS[x.device.index if x.device.index is not None else torch.cuda.current_device()]
        # The tokens are the contraction dim here: zero-padded to whole 1x128 blocks (cuBLAS:
        # a multiple of 4 blocks).
        pad = (-gy2.shape[0]) % (4 * TILE if rows == "scaled_mm" else TILE)
        gq, sg = quantize_act_1x128(torch.nn.functional.pad(gy2.t(), (0, pad)).contiguous())
        xq, sx = quantize_act_1x128(torch.nn.functional.pad(x2.t(), (0, pad)).contiguous())
        gw = rows_mm(gq, sg, xq, sx, gy.dtype, rows)
        return gx.reshape(x.shape), gw, None, None
