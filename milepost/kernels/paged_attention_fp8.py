"""Decode attention over an fp8 (e4m3) KV pool that reads the pool four values a 32-bit word and
widens them with integer operations (issue 23, the FP8 KV pool's speed; behind
`paged_attention.FP8_POOL_WORDS`, on: 1.05-1.13x the widening kernel on an H200, 2026-12-06).

Why: on an H100 (2026-12-06) the bf16-query kernel over an fp8 pool streamed ~1.8 TB/s against
~2.7 for a bf16 pool. Compiled for sm_90, its fp8 tiles move by 8-byte async copies and reach the
MMA by one-byte shared-memory loads, then two conversions a value (e4m3 -> f16 -> bf16); dots in
fp16 (one conversion) were only 1.03x faster. This kernel loads [BLOCK_N, D/4] int32 words (16
bytes a thread, as the bf16 pool's loads) and widens each byte in registers:

    fp16 bits = (b & 0x80) << 8 | (b & 0x7F) << 7,   the fp16 value = the e4m3 value * 2^-8,

exact for every e4m3 value, subnormals and signed zeros included (e4m3's 4 exponent bits land in
fp16's 5 with the biases 7 and 15 eight apart). The 2^-8 of the keys goes into the softmax scale
and that of the values into the output, both exact powers of two. A word's byte j is head
dimension 4i + j, so the query is split the same way and the scores are the sum of four dots of
D/4; the output's four parts are interleaved back at the end.

Numerics against the bf16-query kernel: products are exact in both (a bf16 query and an e4m3 key
are exact in fp16; a query past fp16's +-65504 is clamped there, below 6.1e-5 it loses bits as an
fp16 subnormal), the scores are the same fp32 sums in another order, and the probabilities are
rounded to fp16 for P.V (three more mantissa bits than bf16). An e4m3 NaN (0x7F/0xFF: only a NaN
activation stores one; the pool saturates everything else at +-448) widens to 480, not NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from milepost.kernels.paged_attention import decode_range, store_decode


@triton.jit
def _widen(words, j: tl.constexpr):
    """Byte j of each int32 word (e4m3) as fp16 holding the value * 2^-8."""
    b = (words >> (8 * j)) & 0xFF
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit(do_not_specialize=["stride_tb"])  # as paged_attention._decode_split_kernel
def _decode_fp8_words_kernel(Q, KW, VW, tables, seq_lens, O_part, L_part, Out, scale,
                             stride_qt, stride_qh, stride_ct, stride_ch, stride_tb,
                             stride_ob, stride_os, stride_oh, stride_lb, stride_ls,
                             stride_xt, stride_xh, QV, QS, stride_qs,
                             GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                             PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                             NUM_SPLITS: tl.constexpr, QUANT: tl.constexpr = False):
    """paged_attention._decode_split_kernel's ranges, split-K and outputs over int32 views KW, VW
    ([slots, Hkv, D/4]) of the fp8 pool; strides of the pool in words."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start, end = decode_range(seq_lens, b, split, BLOCK_N, NUM_SPLITS)

    W: tl.constexpr = D // 4
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < GROUP
    heads = kvh * GROUP + hh
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None],
                other=0.0)
    q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    # q[:, 4i + j] as qj[:, i]: dimension 4i + j = 4i + 2a + c, split on c then on a
    qc0, qc1 = tl.split(tl.reshape(q, [BLOCK_H, W, 2, 2]))
    q0, q2 = tl.split(qc0)
    q1, q3 = tl.split(qc1)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, W], tl.float32)
    acc1 = tl.zeros([BLOCK_H, W], tl.float32)
    acc2 = tl.zeros([BLOCK_H, W], tl.float32)
    acc3 = tl.zeros([BLOCK_H, W], tl.float32)
    key_scale = scale * 256.0  # the keys' 2^-8
    dw = tl.arange(0, W)
    table = tables + b.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        blk = tl.load(table + pos // PAGE, mask=pmask, other=0).to(tl.int64)
        slot = blk * PAGE + pos % PAGE
        off = slot[:, None] * stride_ct + kvh * stride_ch + dw[None, :]
        kw = tl.load(KW + off, mask=pmask[:, None], other=0)
        s = tl.dot(q0, tl.trans(_widen(kw, 0)))
        s += tl.dot(q1, tl.trans(_widen(kw, 1)))
        s += tl.dot(q2, tl.trans(_widen(kw, 2)))
        s += tl.dot(q3, tl.trans(_widen(kw, 3)))
        s = tl.where(pmask[None, :], s * key_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(tl.float16)
        vw = tl.load(VW + off, mask=pmask[:, None], other=0)
        acc0 = acc0 * alpha[:, None] + tl.dot(p16, _widen(vw, 0))
        acc1 = acc1 * alpha[:, None] + tl.dot(p16, _widen(vw, 1))
        acc2 = acc2 * alpha[:, None] + tl.dot(p16, _widen(vw, 2))
        acc3 = acc3 * alpha[:, None] + tl.dot(p16, _widen(vw, 3))
        m_i = m_new
    # dimension 4i + 2a + c from the four parts, and the values' 2^-8 back (exact)
    acc = tl.reshape(tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)), [BLOCK_H, D]) * 256.0
    store_decode(acc, m_i, l_i, b, split, heads, hmask, d, O_part, L_part, Out, stride_ob,
                 stride_os, stride_oh, stride_lb, stride_ls, stride_xt, stride_xh, NUM_SPLITS,
                 QV, QS, stride_qs, QUANT)


def launch_fp8_words(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, page: int,
                     num_splits: int, block_n: int, num_warps: int, num_stages: int,
                     o_part: torch.Tensor, l_part: torch.Tensor, out: torch.Tensor,
                     quant: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    """The word-loading kernel in place of _decode_split_kernel (same grid, parts and output);
    k_cache/v_cache: float8_e4m3fn [slots, Hkv, D], D a multiple of 4, rows contiguous.
    quant: (fp8 values, scales, scales' head stride) of a quantized output (stride 0: none)."""
    kw, vw = k_cache.view(torch.int32), v_cache.view(torch.int32)
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    _decode_fp8_words_kernel[(bsz, kv_heads, num_splits)](
        q, kw, vw, block_tables, seq_lens, o_part, l_part, out, scale,
        q.stride(0), q.stride(1), kw.stride(0), kw.stride(1), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0), l_part.stride(1),
        out.stride(0), out.stride(1), *quant,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim, PAGE=page,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, QUANT=quant[2] > 0, num_warps=num_warps,
        num_stages=num_stages,
    )
