"""W4A16 GEMM for the INT4 engines: y = x @ W^T with W packed INT4 (two's-complement nibbles, two
a byte, element 2i in the low nibble) and one float32 scale per 128 weights of a row
(milepost/lowprec/quantize.py's int4 format).

The weights the product uses are the ones the trainer's fake-quant forward uses, bit for bit:
each nibble times its group's scale in float32, rounded once to the activation dtype. At decode
M (<= INT4_DECODE_M rows on CUDA) one Triton kernel does that in registers from the packed bytes,
so a step reads half a byte per weight instead of bf16's two; K is split over programs when N
alone leaves SMs idle (fp32 parts summed in a fixed order: never timing-dependent). At prefill M
on CUDA one Triton kernel dequantizes the weight into a temporary in the activation dtype (the
same bits as torch's dequantization) and cuBLAS multiplies: the GEMM is compute-bound there and
the dense bytes live for one projection. Everywhere else (CPU, a device whose probe failed) torch
unpacks and dequantizes, then F.linear: the same values.

With zero points (an AWQ or asymmetric GPTQ checkpoint served as stored: int8 [N, ceil(K/128)],
each group's zero point - 8) every path computes (value - zero) * scale in float32: the
difference of two small integers is exact, so the product rounds once, as without them.
"""

from __future__ import annotations

import itertools
import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from milepost.kernels.fp8_decode import sum_split_parts
from milepost.lowprec import int4_gemm_table
from milepost.lowprec.elements import unpack_int4
from milepost.lowprec.formats import INT4_GROUP

log = logging.getLogger(__name__)
INT4_DECODE_M = 256  # rows up to which the kernel runs; prefill-sized M takes the torch path
_OK: dict[int, bool] = {}  # device index -> whether the kernel passed its probe there


class W4Config(NamedTuple):
    block_m: int  # activation rows per program (16, 32, 64: tl.dot needs 16 or more)
    block_n: int  # weight rows per program
    split: int  # programs along K (1: no partial sums)
    warps: int = 4
    stages: int = 3


INT4_BUCKETS = (1, 8, 16, 32, 64, 128, 256)  # M rounded up to one of these picks the table's config
# (N, K, M bucket) -> config, measured on an H100 (milepost/lowprec/int4_gemm_table.py)
INT4_TABLE: dict[tuple[int, int, int], W4Config] = {
    key: W4Config(*cfg) for key, cfg in int4_gemm_table.H100.items()}


def w4_config(m: int, n: int, k: int, sms: int) -> W4Config:
    """The measured config for this shape and M bucket, else `w4_rule`'s."""
    bucket = next((b for b in INT4_BUCKETS if m <= b), INT4_BUCKETS[-1])
    return INT4_TABLE.get((n, k, bucket)) or w4_rule(m, n, k, sms)


def w4_rule(m: int, n: int, k: int, sms: int) -> W4Config:
    """The smallest row block that holds M (64 at most), 64-wide weight blocks, and K split until
    about two programs per SM stream a part (decode M reads each weight byte once; the split
    keeps every SM streaming). Within 0-30% of the best config at the measured shapes (H100:
    slowest against it at M <= 16 on wide N, where one program per 32 rows and no split won)."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn = 64
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    n_kb = triton.cdiv(k, INT4_GROUP)
    split = max(1, min(n_kb // 2, 2 * sms // tiles)) if n_kb > 1 else 1
    return W4Config(bm, bn, split)


@triton.jit
def _nibbles(b, BLOCK_N: tl.constexpr):
    """[BLOCK_N, 64] bytes (int32) -> [BLOCK_N, 128] float32 values (-8..7), element 2i from the
    low nibble. n ^ 8 is the value + 8 (0..15); OR-ed into the bits of 2^23 it is 2^23 + value + 8
    as a float32, exactly, and subtracting 2^23 + 8 leaves the value: two full-rate ops instead of
    an int -> float conversion, which runs at a quarter of the FMA rate (the kernel's bottleneck
    once the bytes are halved twice)."""
    u = tl.reshape(tl.join((b & 15) ^ 8, (b >> 4) ^ 8), (BLOCK_N, 128))  # [.., 64, 2]: 2i, 2i+1
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


@triton.jit(do_not_specialize=["M", "kb_per"])
def _w4a16_kernel(X, W, S, Z, C, M, N, K, KP, stride_x, stride_w, stride_s, stride_c, stride_p,
                  n_kb, kb_per, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  IEEE: tl.constexpr, PARTS: tl.constexpr, ZERO: tl.constexpr):
    """Over this program's 128-wide K groups: unpack the [BLOCK_N, 64] bytes to [BLOCK_N, 128]
    ints (minus the group's zero point where ZERO: Z is int8 laid out as S), times the group's
    scale (float32), rounded to X's dtype, and tl.dot with X's rows.
    PARTS: the fp32 sum is part pid_k of C ([split, M, N]); else it is C, in C's dtype."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, 128)
    rb = tl.arange(0, 64)
    row_ok, col_ok = rm < M, rn < N
    x_ptr = X + rm[:, None].to(tl.int64) * stride_x
    w_ptr = W + rn[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = pid_k * kb_per
    for kb in range(k0, tl.minimum(k0 + kb_per, n_kb)):
        kk = kb * 128 + rk
        x = tl.load(x_ptr + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
        bb = kb * 64 + rb
        b = tl.load(w_ptr + bb[None, :], mask=col_ok[:, None] & (bb < KP)[None, :], other=0)
        v = _nibbles(b.to(tl.int32), BLOCK_N)  # two's-complement nibbles: (n ^ 8) - 8
        if ZERO:  # an exact float32 difference of small integers
            v = v - tl.load(Z + rn * stride_s + kb, mask=col_ok, other=0).to(tl.float32)[:, None]
        s = tl.load(S + rn * stride_s + kb, mask=col_ok, other=0.0)
        w = (v * s[:, None]).to(X.dtype.element_ty)  # dequantize's float32 product, rounded
        if IEEE:  # fp32 activations: a true fp32 product (not tf32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    offs = rm[:, None].to(tl.int64) * stride_c + rn[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if PARTS:
        tl.store(C + pid_k * stride_p + offs, acc, mask=mask)
    else:
        tl.store(C + offs, acc.to(C.dtype.element_ty), mask=mask)


def w4a16_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, k: int,
             cfg: W4Config | None = None, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] (bf16/fp16/fp32) times the INT4 weight (packed uint8 [N, ceil(k/2)], float32
    scales [N, ceil(k/128)], optional int8 zero points shaped as the scales) -> [M, N] in x's
    dtype, by the Triton kernel."""
    x = x.contiguous()
    scales, zeros = _same_layout(scales, zeros)
    m, n = x.shape[0], packed.shape[0]
    n_kb = triton.cdiv(k, INT4_GROUP)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    cfg = cfg or w4_config(m, n, k, sms)
    kb_per = triton.cdiv(n_kb, cfg.split)
    split = triton.cdiv(n_kb, kb_per)  # no program without K groups
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    _w4a16_kernel[grid](x, packed, scales, zeros if zeros is not None else scales, dst, m, n, k,
                        packed.shape[1], x.stride(0), packed.stride(0), scales.stride(0),
                        out.stride(0), m * n, n_kb, kb_per,
                        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                        IEEE=x.dtype == torch.float32, PARTS=split > 1, ZERO=zeros is not None,
                        num_warps=cfg.warps, num_stages=cfg.stages)
    if split > 1:  # the parts in order 0, 1, ... then cast: one launch, no atomics
        sum_split_parts(dst, out)
    return out


def _same_layout(scales: torch.Tensor, zeros: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernels index zero points with the scales' row stride: give both one layout."""
    if zeros is None or zeros.stride() == scales.stride():
        return scales, zeros
    return scales.contiguous(), zeros.contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, k: int,
                    dtype: torch.dtype, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The [N, k] weight in `dtype`: quantize.dequantize's float32 product, cast once."""
    s = scales.repeat_interleave(INT4_GROUP, 1)[:, :k]
    v = unpack_int4(packed, k).float()
    if zeros is not None:
        v = v - zeros.float().repeat_interleave(INT4_GROUP, 1)[:, :k]
    return (v * s).to(dtype)


@triton.jit
def _dequant_kernel(W, S, Z, O, N, K, KP, stride_w, stride_s, stride_o, BLOCK_N: tl.constexpr,
                    ZERO: tl.constexpr):
    """One [BLOCK_N, 128] group column of the weight: nibbles (minus the group's zero point
    where ZERO) times the group scale in float32, cast to O's dtype (dequantize_int4's
    operations, so its bits)."""
    pid_n, kb = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    bb = kb * 64 + tl.arange(0, 64)
    kk = kb * 128 + tl.arange(0, 128)
    col_ok = rn < N
    b = tl.load(W + rn[:, None].to(tl.int64) * stride_w + bb[None, :],
                mask=col_ok[:, None] & (bb < KP)[None, :], other=0).to(tl.int32)
    v = _nibbles(b, BLOCK_N)
    if ZERO:
        v = v - tl.load(Z + rn * stride_s + kb, mask=col_ok, other=0).to(tl.float32)[:, None]
    s = tl.load(S + rn * stride_s + kb, mask=col_ok, other=0.0)
    w = (v * s[:, None]).to(O.dtype.element_ty)
    tl.store(O + rn[:, None].to(tl.int64) * stride_o + kk[None, :], w,
             mask=col_ok[:, None] & (kk < K)[None, :])


def dequantize_int4_triton(packed: torch.Tensor, scales: torch.Tensor, k: int,
                           dtype: torch.dtype, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize_int4 in one Triton kernel (the same bits)."""
    n = packed.shape[0]
    scales, zeros = _same_layout(scales, zeros)
    out = torch.empty((n, k), dtype=dtype, device=packed.device)
    if n:
        grid = (triton.cdiv(n, 32), triton.cdiv(k, INT4_GROUP))
        _dequant_kernel[grid](packed, scales, zeros if zeros is not None else scales, out, n, k,
                              packed.shape[1], packed.stride(0), scales.stride(0), out.stride(0),
                              BLOCK_N=32, ZERO=zeros is not None)
    return out


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, k: int,
                bias: torch.Tensor | None = None, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for x [.., k] (`zeros`: the groups' zero points, or None). On CUDA
    where the kernels passed their probe: the W4A16 kernel up to INT4_DECODE_M rows, else the
    Triton dequantization + F.linear; elsewhere torch's unpack + dequantize + F.linear."""
    rows = x.reshape(-1, k)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and kernel_ok(x.device):
        if rows.shape[0] <= INT4_DECODE_M:
            y = w4a16_mm(rows, packed, scales, k, zeros=zeros).reshape(*x.shape[:-1], packed.shape[0])
            return y + bias if bias is not None else y
        return F.linear(x, dequantize_int4_triton(packed, scales, k, x.dtype, zeros), bias)
    return F.linear(x, dequantize_int4(packed, scales, k, x.dtype, zeros), bias)


def kernel_ok(device: torch.device) -> bool:
    """Whether the W4A16 kernel gives dequantize-then-matmul's product on `device` and the
    Triton dequantization torch's bits (probed once: rows whose group scales differ by orders of
    magnitude, an uneven split, N and K not multiples of the blocks; kernels that fail are logged
    and never used)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _OK:
        _OK[idx] = _probe(torch.device("cuda", idx))
    return _OK[idx]


def _probe(device: torch.device) -> bool:
    from milepost.lowprec.quantize import quantize

    if torch.cuda.get_device_capability(device) < (8, 0):
        log.warning("int4: compute capability < 8.0: the W4A16 kernel is off (bf16 tl.dot); "
                    "the engine unpacks and dequantizes the weights per GEMM")
        return False
    g = torch.Generator().manual_seed(0)
    n, k = 200, 5 * INT4_GROUP + 64
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, k // 8 + 1).repeat_interleave(8)[:k]
    q = quantize(w, "int4")
    packed, scales = q.values.to(device), q.scales.to(device)
    # Zero points as AWQ's (zero - 8 in -8..7, asymmetric GPTQ v1's up to 8), per group.
    offsets = torch.randint(-8, 9, tuple(q.scales.shape), generator=g, dtype=torch.int8).to(device)
    try:
        for dtype, zeros in itertools.product((torch.bfloat16, torch.float16, torch.float32),
                                              (None, offsets)):
            want = dequantize_int4(packed, scales, k, dtype, zeros)
            if not torch.equal(dequantize_int4_triton(packed, scales, k, dtype, zeros), want):
                raise ValueError(f"the Triton dequantization differs from torch's in {dtype} "
                                 f"({'with' if zeros is not None else 'without'} zero points)")
        for (m, dtype), zeros in itertools.product(
                ((1, torch.bfloat16), (37, torch.bfloat16), (16, torch.float32)), (None, offsets)):
            x = torch.randn(m, k, generator=g).to(device, dtype)
            ref = F.linear(x.float(), dequantize_int4(packed, scales, k, dtype, zeros).float())
            for cfg in (None, W4Config(16, 64, 3)):
                y = w4a16_mm(x, packed, scales, k, cfg, zeros).float()
                tol = (1e-2 if dtype != torch.float32 else 1e-4) * ref.abs().amax(1, keepdim=True)
                if not ((y - ref).abs() <= tol).all():
                    raise ValueError(f"M={m} {dtype} {cfg} zeros={zeros is not None}: off by "
                                     f"{(y - ref).abs().max().item():.3g}")
    except Exception as e:  # noqa: BLE001 - a compile error or a wrong product: never use it
        log.warning("int4: the W4A16 kernels failed their probe on %s (%s); the engine unpacks "
                    "and dequantizes the weights with torch per GEMM instead", device, e)
        return False
    return True
