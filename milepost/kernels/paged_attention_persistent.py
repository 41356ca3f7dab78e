"""Unsplit decode attention as a persistent kernel: a fixed number of programs, each walking its
(sequence, kv head) items' key tiles in one flat loop (issue 27, decode closer to the bandwidth
bound; behind `paged_attention.PERSISTENT_DECODE`, off: timed on an H200 (2026-12-06) it was no
faster than the unsplit kernel: 0.45-0.52x at 1 program per SM, 0.78-0.81x at 2, 1.02-1.03x at 4
on 256 sequences and 0.95x on 64).

Why: benchmark (a)'s decode (256 sequences x 8 kv heads, ~257 keys) launches 2,048 programs of
four or five 64-key tiles each, about eight waves of them. Each program starts with an empty
software pipeline: its first tiles wait a full memory latency, and with so few tiles a program
that wait is a large share of its life. Measured, the kernel streams ~2.7 TB/s on an H100 (81%
of the peak) and ~3.4 TB/s on an H200 (70%), with no block, warp, stage or split config more
than 3% faster. Here each program takes items pid, pid + P, pid + 2P, ... and iterates over the
concatenation of their tiles, so the loads of an item's first tiles are issued while the
previous item's last tiles are being scored (the pattern of Triton's persistent matmul: the
epilogue under a condition inside the pipelined loop).

Same arithmetic per item as `_decode_split_kernel` with one split: the same tiles in the same
order, the same online-softmax updates, the same output division. A sequence of length 0
(graph padding rows) takes one all-masked tile and writes zeros, as the unsplit kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_tb"])  # as paged_attention._decode_split_kernel
def _decode_persistent_kernel(Q, KC, VC, tables, seq_lens, Out, scale, n_items,
                              stride_qt, stride_qh, stride_ct, stride_ch, stride_tb,
                              stride_xt, stride_xh,
                              KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                              BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # This program's tiles over all its items (an empty sequence counts one masked tile).
    total = tl.full([], 0, tl.int32)
    for item in range(pid, n_items, nprog):
        n = tl.load(seq_lens + item // KV_HEADS).to(tl.int32)
        total += tl.maximum((n + BLOCK_N - 1) // BLOCK_N, 1)

    hh = tl.arange(0, BLOCK_H)
    hmask = hh < GROUP
    d = tl.arange(0, D)
    item = pid.to(tl.int32)
    n0 = tl.full([], 0, tl.int32)  # the current tile's first key within the current item
    q = tl.zeros([BLOCK_H, D], Q.dtype.element_ty)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for _ in range(0, total):
        b = item // KV_HEADS
        kvh = item % KV_HEADS
        seq_len = tl.load(seq_lens + b).to(tl.int32)
        heads = kvh * GROUP + hh
        first = n0 == 0
        # the query is read at an item's first tile only (no traffic for a masked load)
        q_rows = hh < tl.where(first, GROUP, 0)
        q_new = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=q_rows[:, None], other=0.0)
        q = tl.where(first, q_new, q)
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < seq_len
        blk = tl.load(tables + b.to(tl.int64) * stride_tb + pos // PAGE, mask=pmask,
                      other=0).to(tl.int64)
        kv_off = (blk * PAGE + pos % PAGE)[:, None] * stride_ct + kvh * stride_ch + d[None, :]
        k = tl.load(KC + kv_off, mask=pmask[:, None], other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(pmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # An all-masked tile (empty sequence) keeps m = -inf: subtract 0 there, so p and alpha
        # are 0 instead of NaN; any other row subtracts m_new as the unsplit kernel does.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_sub[:, None])
        alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + kv_off, mask=pmask[:, None], other=0.0).to(q.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        last = n0 + BLOCK_N >= seq_len
        if last:
            has = l_i > 0.0
            out = acc / tl.where(has, l_i, 1.0)[:, None]
            tl.store(Out + b * stride_xt + heads[:, None] * stride_xh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=hmask[:, None])
        m_i = tl.where(last, float("-inf"), m_i)
        l_i = tl.where(last, 0.0, l_i)
        acc = tl.where(last, 0.0, acc)
        item = tl.where(last, item + nprog, item)
        n0 = tl.where(last, 0, n0 + BLOCK_N)


_SMS: dict[int, int] = {}


def persistent_programs(n_items: int, num_sms: int, per_sm: int) -> int:
    """Programs for n_items items: at most num_sms * per_sm (one wave), as few as give every
    program the same number of items as the busiest one (2,048 items on 132 SMs x 2: 256
    programs of 8, not 264 of 7.76)."""
    slots = max(1, num_sms * per_sm)
    per_program = -(-n_items // slots)
    return max(1, -(-n_items // per_program))


def persistent_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      page: int, out: torch.Tensor, block_n: int = 64, num_warps: int = 2,
                      num_stages: int = 3, per_sm: int = 4) -> torch.Tensor:
    """`paged_attention.paged_decode` with one split, by the persistent kernel; writes `out`."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    if q.is_cuda:
        index = q.device.index or 0
        if index not in _SMS:
            _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
        num_sms = _SMS[index]
    else:  # Triton's interpreter: a few programs, so each walks several items
        num_sms = 2
    n_items = bsz * kv_heads
    grid = (persistent_programs(n_items, num_sms, per_sm),)
    _decode_persistent_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale, n_items,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        KV_HEADS=kv_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=dim,
        PAGE=page, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
