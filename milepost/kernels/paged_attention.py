"""Triton kernels for attention over the paged KV cache: KV store, split-K decode, varlen prefill.

Cache layout (milepost.models.attention.PagedKVCache): per layer K and V of [slots, Hkv, D], slot =
block_id * page + offset. Semantics equal `TorchPagedAttention`: each sequence's queries are its
last `query_len` positions, causal mask aligned bottom-right over its whole KV (cached prefix plus
the new tokens), GQA by head groups. Decode splits each sequence's KV into NUM_SPLITS ranges
(flash-decoding) so small batches still fill the GPU, then a second kernel merges the ranges by
their log-sum-exp. Every launch takes its sizes from device tensors, so it can be graph-captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from milepost.kernels.fp8_quant import quant_blocks_1x128
from milepost.kernels.fused_ops import load_rounded, norm_rope_rows
from milepost.lowprec.fp8_act import PAD_ROWS, Fp8Act, SplitSum

# Decode over an fp8 pool by paged_attention_fp8's kernel (the pool read as 32-bit words, widened
# with integer operations, fp16 dots): 1.05x this file's widening kernel at 256 sequences x 256
# tokens and 1.13x at 64 x 256 on an H200 (2026-12-06, benchmarks/decode_attention_sweep.py
# --kv-dtype fp8_e4m3). False sends fp8 pools to this file's kernel.
FP8_POOL_WORDS = True
# Unsplit decode by paged_attention_persistent's kernel (one wave of programs, each walking its
# items' tiles in one pipelined loop): off, slower on an H200 (2026-12-06: 0.81x this file's
# kernel at 2 programs per SM, 1.02-1.03x at 4 on 256 sequences but 0.95x on 64; benchmark (a)
# 55.5k against 67.1k tok/s at 2 per SM).
PERSISTENT_DECODE = False


@triton.jit
def _store_kv_kernel(K, V, KC, VC, slots, stride_kt, stride_vt, stride_ct, ROW: tl.constexpr,
                     BLOCK: tl.constexpr, SATURATE: tl.constexpr):
    """Copy token t's K and V rows ([Hkv * D] each) into cache slot slots[t]; slot < 0 = padding."""
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        for c in range(0, ROW, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            m = offs < ROW
            k = tl.load(K + t * stride_kt + offs, mask=m)
            v = tl.load(V + t * stride_vt + offs, mask=m)
            if SATURATE:  # an fp8 pool: clamp to +-448 (models/attention.py to_cache)
                k = tl.minimum(tl.maximum(k.to(tl.float32), -448.0), 448.0)
                v = tl.minimum(tl.maximum(v.to(tl.float32), -448.0), 448.0)
            tl.store(KC + slot * stride_ct + offs, k.to(KC.dtype.element_ty), mask=m)
            tl.store(VC + slot * stride_ct + offs, v.to(VC.dtype.element_ty), mask=m)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v: [T, Hkv, D] new tokens -> cache rows `slots` ([T] int32/int64; negative rows skipped)."""
    t = k.shape[0]
    if t == 0:
        return
    k2, v2 = k.reshape(t, -1), v.reshape(t, -1)  # views when [T, Hkv, D] is contiguous per token
    row = k2.shape[1]
    _store_kv_kernel[(t,)](k2, v2, k_cache, v_cache, slots, k2.stride(0), v2.stride(0),
                           k_cache.stride(0), ROW=row, BLOCK=min(1024, triton.next_power_of_2(row)),
                           SATURATE=k_cache.dtype == torch.float8_e4m3fn)


@triton.jit
def _rope_store_kernel(QKV, QW, KW, COS, SIN, QO, KC, VC, slots, stride_t, stride_qt, stride_ct,
                       stride_cos, n_q, n_kv, eps, stride_ps, HALF: tl.constexpr, HQ: tl.constexpr,
                       HKV: tl.constexpr, HAS_NORM: tl.constexpr, SATURATE: tl.constexpr,
                       SPLIT: tl.constexpr):
    """One token of a fused q|k|v row: q normed and rotated into QO, k normed and rotated and v
    copied into cache slot slots[t] (slot < 0 = padding: nothing stored). SPLIT > 0: QKV holds
    the projection's unsummed split parts, stride_ps apart (fused_ops.load_rounded)."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, HALF)
    dtype = QO.dtype.element_ty
    c = tl.load(COS + t * stride_cos + i).to(tl.float32)[None, :]  # cos/sin rows: cat(f, f)
    s = tl.load(SIN + t * stride_cos + i).to(tl.float32)[None, :]
    row = QKV + t * stride_t
    hq = tl.arange(0, HQ)
    qmask = (hq < n_q)[:, None]
    q1, q2 = norm_rope_rows(row, QW, c, s, hq, qmask, i, eps, 2 * HALF, HALF, HAS_NORM, dtype,
                            stride_ps, SPLIT)
    out = QO + t * stride_qt + hq[:, None] * (2 * HALF) + i[None, :]
    tl.store(out, q1, mask=qmask)
    tl.store(out + HALF, q2, mask=qmask)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:
        hk = tl.arange(0, HKV)
        kmask = (hk < n_kv)[:, None]
        k1, k2 = norm_rope_rows(row + n_q * 2 * HALF, KW, c, s, hk, kmask, i, eps, 2 * HALF, HALF,
                                 HAS_NORM, dtype, stride_ps, SPLIT)
        v_row = row + (n_q + n_kv) * 2 * HALF + hk[:, None] * (2 * HALF) + i[None, :]
        v1 = load_rounded(v_row, kmask, stride_ps, SPLIT, dtype)  # fp32 of dtype's values
        v2 = load_rounded(v_row + HALF, kmask, stride_ps, SPLIT, dtype)
        if SATURATE:  # an fp8 pool: clamp to +-448 as _store_kv_kernel does
            k1 = tl.minimum(tl.maximum(k1.to(tl.float32), -448.0), 448.0)
            k2 = tl.minimum(tl.maximum(k2.to(tl.float32), -448.0), 448.0)
            v1 = tl.minimum(tl.maximum(v1.to(tl.float32), -448.0), 448.0)
            v2 = tl.minimum(tl.maximum(v2.to(tl.float32), -448.0), 448.0)
        off = slot * stride_ct + hk[:, None] * (2 * HALF) + i[None, :]
        tl.store(KC + off, k1.to(KC.dtype.element_ty), mask=kmask)
        tl.store(KC + off + HALF, k2.to(KC.dtype.element_ty), mask=kmask)
        tl.store(VC + off, v1.to(VC.dtype.element_ty), mask=kmask)
        tl.store(VC + off + HALF, v2.to(VC.dtype.element_ty), mask=kmask)


def rope_store(qkv: torch.Tensor | SplitSum, num_heads: int, num_kv_heads: int,
               q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
               cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """qkv: [T, (H + 2 Hkv) D] (a fused q|k|v projection's rows, or its unsummed split parts)
    -> q [T, H, D] normed and rotated; k normed and rotated and v go straight into the cache rows
    `slots`: one launch for what fused_ops.norm_rope (twice) and store_kv do in three, with the
    same bits."""
    split, stride_ps, dtype = 0, 0, qkv.dtype
    if isinstance(qkv, SplitSum):
        split, stride_ps, qkv = qkv.parts.shape[0], qkv.parts.stride(0), qkv.parts[0]
    t = qkv.shape[0]
    dim = k_cache.shape[-1]
    q = torch.empty((t, num_heads, dim), dtype=dtype, device=qkv.device)
    if t == 0:
        return q
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rope_store normalizes both q and k or neither")
    if k_cache.stride(1) != dim or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("rope_store needs cache rows of [Hkv, D] contiguous per slot")
    _rope_store_kernel[(t,)](
        qkv, q_weight if q_weight is not None else qkv, k_weight if k_weight is not None else qkv,
        cos, sin, q, k_cache, v_cache, slots, qkv.stride(0), q.stride(0), k_cache.stride(0),
        cos.stride(0), num_heads, num_kv_heads, eps, stride_ps, HALF=dim // 2,
        HQ=triton.next_power_of_2(num_heads), HKV=triton.next_power_of_2(num_kv_heads),
        HAS_NORM=q_weight is not None, SATURATE=k_cache.dtype == torch.float8_e4m3fn, SPLIT=split,
    )
    return q


@triton.jit
def decode_range(seq_lens, b, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """[start, end) of sequence b's keys that split `split` attends to: whole BLOCK_N tiles, the
    tiles shared out evenly, the last range cut at the sequence's length (empty past it)."""
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    per_split = (tiles + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * per_split * BLOCK_N
    return start, tl.minimum(start + per_split * BLOCK_N, seq_len)


@triton.jit
def store_decode(acc, m_i, l_i, b, split, heads, hmask, d, O_part, L_part, Out, stride_ob,
                 stride_os, stride_oh, stride_lb, stride_ls, stride_xt, stride_xh,
                 NUM_SPLITS: tl.constexpr, QV, QS, stride_qs, QUANT: tl.constexpr):
    """The range's result acc / l: the output itself (one range), else its part and log-sum-exp
    for _decode_merge_kernel. QUANT (one range, head dim 128): instead of the output, its
    values rounded to Out's dtype and quantized per head (one 1 x 128 block each) into QV
    ([rows, H * 128] fp8) and QS (scales, head h of row b at h * stride_qs + b): the bits
    quantize_rows_fp8 gives of the output (an Fp8Act for o_proj, lowprec/fp8_act.py)."""
    has = l_i > 0.0  # an empty range (short sequence, padding row) contributes weight 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if QUANT:
        y = out.to(Out.dtype.element_ty).to(tl.float32)
        qv, qs = quant_blocks_1x128(y)
        tl.store(QV + b * stride_xt + heads[:, None] * 128 + d[None, :], qv, mask=hmask[:, None])
        tl.store(QS + heads * stride_qs + b, qs, mask=hmask)
    elif NUM_SPLITS == 1:  # one range: the result is final, no merge pass
        x_ptr = Out + b * stride_xt + heads[:, None] * stride_xh + d[None, :]
        tl.store(x_ptr, out.to(Out.dtype.element_ty), mask=hmask[:, None])
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        o_ptr = O_part + b * stride_ob + split * stride_os + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr, out, mask=hmask[:, None])
        tl.store(L_part + b * stride_lb + split * stride_ls + heads, lse, mask=hmask)


# stride_tb is not specialized: the eager steps' block tables are as wide as the batch's longest
# sequence, so its class (1, divisible by 16, other) changes from step to step, and each new
# class compiled the kernel again in the middle of serving (engine/kernel_warmup.py).
@triton.jit(do_not_specialize=["stride_tb"])
def _decode_split_kernel(Q, KC, VC, tables, seq_lens, O_part, L_part, Out, scale,
                         stride_qt, stride_qh, stride_ct, stride_ch, stride_tb,
                         stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_xt, stride_xh,
                         QV, QS, stride_qs,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         IEEE: tl.constexpr, QUANT: tl.constexpr = False):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start, end = decode_range(seq_lens, b, split, BLOCK_N, NUM_SPLITS)

    hh = tl.arange(0, BLOCK_H)
    hmask = hh < GROUP
    heads = kvh * GROUP + hh
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None],
                other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    table = tables + b.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        blk = tl.load(table + pos // PAGE, mask=pmask, other=0).to(tl.int64)
        slot = blk * PAGE + pos % PAGE
        kv_off = slot[:, None] * stride_ct + kvh * stride_ch + d[None, :]
        k = tl.load(KC + kv_off, mask=pmask[:, None], other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(pmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + kv_off, mask=pmask[:, None], other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    store_decode(acc, m_i, l_i, b, split, heads, hmask, d, O_part, L_part, Out, stride_ob,
                 stride_os, stride_oh, stride_lb, stride_ls, stride_xt, stride_xh, NUM_SPLITS,
                 QV, QS, stride_qs, QUANT)


@triton.jit
def _decode_merge_kernel(O_part, L_part, Out, stride_ob, stride_os, stride_oh, stride_lb,
                         stride_ls, stride_xt, stride_xh, D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D)
    lse = tl.load(L_part + b * stride_lb + s * stride_ls + h)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all ranges empty (padding row): output zeros
    w = tl.exp(lse - m)
    o = tl.load(O_part + b * stride_ob + s[:, None] * stride_os + h * stride_oh + d[None, :])
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + b * stride_xt + h * stride_xh + d, out.to(Out.dtype.element_ty))


def decode_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence so batch * kv_heads * splits covers ~2 waves of the SMs (power of 2, <= 32)."""
    want = max(1, -(-2 * num_sms // max(1, batch * num_kv_heads)))
    return min(32, triton.next_power_of_2(want))


def quantizes_out(q: torch.Tensor, num_splits: int) -> bool:
    """Whether paged_decode can hand o_proj its output as an Fp8Act: one range per sequence (no
    merge pass), head dim 128 (a head is one 1 x 128 block), rows a multiple of PAD_ROWS (the
    Fp8Act's padding; the decode graphs' batch sizes from 4 up are) and 16-bit queries."""
    bsz, _, dim = q.shape
    return (num_splits == 1 and dim == 128 and bsz > 0 and bsz % PAD_ROWS == 0
            and q.dtype in (torch.bfloat16, torch.float16))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, page: int,
                 num_splits: int, block_n: int = 64, num_warps: int | None = None,
                 num_stages: int | None = None, out: torch.Tensor | None = None,
                 fp8_out: bool = False) -> torch.Tensor | Fp8Act:
    """q: [B, H, D] (one query per sequence) -> [B, H, D]; seq_lens[b] = 0 gives zeros.
    out: [B, H, D] rows to write (e.g. the decode rows of a mixed batch's output); new if None.
    fp8_out: where `quantizes_out` allows it, the output as [B, H * D] quantized per 1 x 128
    block (an Fp8Act, quantize_rows_fp8's bits) for an FP8 o_proj, made by the attention kernel.

    Unsplit batches run 2 warps and 3 stages: on the H200 (2026-12-04, Qwen3-0.6B heads, bf16)
    78-80 us vs 82.5 us at 256 x 256 keys, 141 vs 150 us at 256 x 512, 76.5 vs 79 us at 64 x 1024
    (benchmarks/engine_gpu_profile.py kernels); split batches keep 4 warps, 2 stages. Scoring on
    CUDA cores instead (no 16-row tensor-core tile for a GQA group of 2) ran no faster on an H100
    (2026-12-06, benchmarks/decode_attention_sweep.py: 107.1 vs 108.5 us at 256 x 256 keys)."""
    if num_warps is None:
        num_warps = 2 if num_splits == 1 else 4
    if num_stages is None:
        num_stages = 3 if num_splits == 1 else 2
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if out is None:
        out = torch.empty_like(q)
    qv = qs = None
    if fp8_out and quantizes_out(q, num_splits) and out.stride(0) == heads * dim:
        qv = torch.empty((bsz, heads * dim), dtype=torch.float8_e4m3fn, device=q.device)
        qs = torch.empty((heads, bsz), dtype=torch.float32, device=q.device).t()
    quant = (qv, qs, bsz) if qv is not None else (out, out, 0)
    parts = num_splits
    o_part = torch.empty((bsz, parts, heads, dim) if num_splits > 1 else (1, 1, 1, 1),
                         dtype=torch.float32, device=q.device)
    l_part = torch.empty((bsz, parts, heads) if num_splits > 1 else (1, 1, 1),
                         dtype=torch.float32, device=q.device)
    if (FP8_POOL_WORDS and k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32
            and dim % 64 == 0):
        from milepost.kernels.paged_attention_fp8 import launch_fp8_words

        launch_fp8_words(q, k_cache, v_cache, block_tables, seq_lens, scale, page, num_splits,
                         block_n, num_warps, num_stages, o_part, l_part, out, quant)
    elif PERSISTENT_DECODE and num_splits == 1 and qv is None:
        from milepost.kernels.paged_attention_persistent import persistent_decode

        return persistent_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, page, out,
                                 block_n, num_warps, num_stages)
    else:
        _decode_split_kernel[(bsz, kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, o_part, l_part, out, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
            o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0),
            l_part.stride(1), out.stride(0), out.stride(1), *quant,
            GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim, PAGE=page,
            BLOCK_N=block_n, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32,
            QUANT=qv is not None, num_warps=num_warps, num_stages=num_stages,
        )
    if qv is not None:
        return Fp8Act(qv, qs, bsz, q.dtype)
    if num_splits == 1:
        return out
    _decode_merge_kernel[(bsz, heads)](
        o_part, l_part, out, o_part.stride(0), o_part.stride(1), o_part.stride(2),
        l_part.stride(0), l_part.stride(1), out.stride(0), out.stride(1), D=dim,
        NUM_SPLITS=num_splits,
    )
    return out


@triton.jit
def _attend_tile(q, KC, VC, table, n0, kvh, d, qpos, kv_end, m_i, l_i, acc, scale, stride_ct,
                 stride_ch, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 IEEE: tl.constexpr):
    """Online-softmax update of (m, l, acc) with keys [n0, n0 + BLOCK_N) read through the table."""
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        pmask = pos < kv_end
        blk = tl.load(table + pos // PAGE, mask=pmask, other=0).to(tl.int64)
    else:
        blk = tl.load(table + pos // PAGE).to(tl.int64)
    kv_off = (blk * PAGE + pos % PAGE)[:, None] * stride_ct + kvh * stride_ch + d[None, :]
    if MASKED:
        k = tl.load(KC + kv_off, mask=pmask[:, None], other=0.0).to(q.dtype)
    else:
        k = tl.load(KC + kv_off).to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if MASKED:
        s = tl.where((pos[None, :] <= qpos[:, None]) & pmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(VC + kv_off, mask=pmask[:, None], other=0.0).to(q.dtype)
    else:
        v = tl.load(VC + kv_off).to(q.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_tb"])  # see _decode_split_kernel
def _prefill_kernel(Q, KC, VC, O, tables, seq_lens, cu_q, tile_seq, tile_m0, scale,
                    stride_qt, stride_qh, stride_ct, stride_ch, stride_tb, stride_ot, stride_oh,
                    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    b = tl.load(tile_seq + tile)
    m0 = tl.load(tile_m0 + tile)
    q_beg = tl.load(cu_q + b).to(tl.int32)
    q_len = tl.load(cu_q + b + 1).to(tl.int32) - q_beg
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    ctx = seq_len - q_len  # cached prefix: query row r sits at position ctx + r

    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    qpos = ctx + rows
    d = tl.arange(0, D)
    q_off = (q_beg + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(Q + q_off, mask=rmask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    table = tables + b.to(tl.int64) * stride_tb

    # Keys before the tile's first query position are visible to every row: no mask needed
    # (a separate loop, so the common part pipelines without a branch).
    full_end = ((ctx + m0) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, KC, VC, table, n0, kvh, d, qpos, kv_end, m_i, l_i, acc,
                                     scale, stride_ct, stride_ch, PAGE, BLOCK_N, False, IEEE)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, KC, VC, table, n0, kvh, d, qpos, kv_end, m_i, l_i, acc,
                                     scale, stride_ct, stride_ch, PAGE, BLOCK_N, True, IEEE)
    out = acc / l_i[:, None]
    o_off = (q_beg + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(O + o_off, out.to(O.dtype.element_ty), mask=rmask[:, None])


PREFILL_BLOCK_M = 128


def prefill_tiles(query_lens: list[int], block_m: int = PREFILL_BLOCK_M,
                  first: int = 0) -> tuple[list[int], list[int]]:
    """(sequence index, first query row) of every BLOCK_M-row tile of a packed batch, for the
    sequences from index `first` on (the ones before are left to the decode kernel)."""
    seqs: list[int] = []
    starts: list[int] = []
    for i in range(first, len(query_lens)):
        for m0 in range(0, query_lens[i], block_m):
            seqs.append(i)
            starts.append(m0)
    return seqs, starts


def leading_decodes(query_lens: list[int]) -> int:
    """How many sequences at the front of a batch compute one query each (the scheduler puts a
    step's decodes first). A mixed batch runs those through the decode kernel: in the prefill
    kernel each of them would take a whole BLOCK_M-row tile per head for its single row."""
    n = 0
    for q in query_lens:
        if q != 1:
            break
        n += 1
    return n


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_q: torch.Tensor,
                  tile_seq: torch.Tensor, tile_m0: torch.Tensor, scale: float, page: int,
                  block_m: int = PREFILL_BLOCK_M, block_n: int = 64,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] packed queries of B sequences (cu_q: [B+1]) -> [T, H, D].

    The new tokens' K/V must already be in the cache (store_kv); tile_seq/tile_m0 come from
    `prefill_tiles` with the same block_m. Only the rows of the sequences the tiles cover are
    written (into `out` when given).
    """
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    ieee = q.dtype == torch.float32
    _prefill_kernel[(tile_seq.shape[0], heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_q, tile_seq, tile_m0, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, D=dim, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=ieee,
        num_warps=8 if block_m >= 128 else 4, num_stages=2,
    )
    return out
