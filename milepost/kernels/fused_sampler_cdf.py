"""The fused sampler's inverse-CDF method: one read of the logits and two uniforms a row.

Pass 1 (`_chunk_stats`, B x splits programs) folds each CHUNK-token chunk of a row into its max
and its sum of exp((x - max) / T) (and, for greedy rows, the index of its first maximum).
Pass 2 (`_select`, one program a row) combines the chunks into the row's log-sum-exp, picks a
chunk with probability mass / total by one uniform, then a token of that chunk by a second
uniform against the chunk's cumulative sum, reading only that chunk's logits again.

Why it is exact (not only "the same distribution up to fp32 rounding of a row-long cumsum"):
a row-long fp32 cumulative sum would give every token an interval that is a whole number of ulps
of the running total (6e-8 of the row near its end), so a token of probability 1e-9 would be
drawn with probability 0 or 6e-8. Here both picks use a fresh 53-bit uniform and fp64 cumulative
sums of fp32 masses (relative error ~1e-6 from exp2), so a token is drawn with probability
p * (1 +- ~1e-6), down to masses ~1e-15 of its chunk. The first pick's fp64 sums hold every chunk
(at most a few hundred); the second's only the chosen chunk. A -inf logit has mass 0 and is never
picked (a pick is always a positive-mass entry, even where the scan rounds at the very end).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # tokens a chunk: the first pick's unit and the second pick's scan width
SELECT_WARPS = 4  # pass 2's scan of one 2048-wide chunk a row


@triton.jit
def _chunk_stats(Z, TEMP, GREEDY, M, S, ARG, n_vocab, n_chunks, stride_z, stride_c,
                 SPLITS: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    base = Z + row * stride_z
    out = row * stride_c
    # exp(d / T) = exp2(d * log2(e) / T): one multiply and the hardware's exp2
    c2 = 1.4426950408889634 / tl.load(TEMP + row)
    greedy = tl.load(GREEDY + row) != 0
    offs = tl.arange(0, CHUNK)
    # chunk c is handled by program c % SPLITS: its numbers do not depend on SPLITS
    for c in range(part, n_chunks, SPLITS):
        cols = c * CHUNK + offs
        x = tl.load(base + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
        if greedy:
            m, arg = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(ARG + out + c, arg + c * CHUNK)
        else:
            m = tl.max(x, 0)
        # x - m, not x / T - m / T: exact for near-ties, which matters at tiny T
        e = tl.exp2((x - m) * c2)
        # an all -inf chunk: -inf - -inf is NaN; it has no mass
        tl.store(M + out + c, m)
        tl.store(S + out + c, tl.where(m == float("-inf"), 0.0, tl.sum(e, 0)))


@triton.jit
def _uniform53(a, b):
    """Two uint32 Philox outputs -> a float64 in [0, 1) on a grid of 2^-53."""
    return ((a >> 5).to(tl.float64) * 67108864.0 + (b >> 6).to(tl.float64)) * (1.0 / 9007199254740992.0)


@triton.jit
def _pick(w, u, N: tl.constexpr):
    """The entry i of w (fp64 >= 0, [N]) with cw[i - 1] <= u * total < cw[i], cw the inclusive
    cumulative sum: entry i is drawn with probability w[i] / total. Only entries with w > 0 can
    be picked; if rounding leaves u * total at or past the end, the last positive entry."""
    cw = tl.cumsum(w, 0)
    target = u * tl.max(cw, 0)
    idx = tl.arange(0, N)
    first = tl.min(tl.where((cw > target) & (w > 0), idx, N), 0)
    last = tl.max(tl.where(w > 0, idx, -1), 0)
    return tl.where(first < N, first, tl.maximum(last, 0))


@triton.jit
def _select(Z, SEED, TEMP, GREEDY, M, S, ARG, TOK, LOGP, n_vocab, n_chunks, stride_z, stride_c,
            NCP: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    stats = row * stride_c
    t = tl.load(TEMP + row)
    c2 = 1.4426950408889634 / t  # the same expression as pass 1: the same bits
    ci = tl.arange(0, NCP)
    m = tl.load(M + stats + ci, mask=ci < n_chunks, other=float("-inf"))
    s = tl.load(S + stats + ci, mask=ci < n_chunks, other=0.0)
    m_all = tl.max(m, 0)
    w = tl.where(s > 0, s * tl.exp2((m - m_all) * c2), 0.0)  # [NCP] chunk masses, max chunk ~1
    if tl.load(GREEDY + row) != 0:
        # the first chunk holding the row's maximum, its first maximum: argmax's token
        tok = tl.load(ARG + stats + tl.min(tl.where(m == m_all, ci, NCP), 0))
        x_tok = m_all
    else:
        # one Philox call: four uint32, two for each pick
        a, b, c, d = tl.randint4x(tl.load(SEED + row), tl.full((), 0, tl.int32))
        chunk = _pick(w.to(tl.float64), _uniform53(a, b), NCP)
        # values at the picked index from registers, not reloaded: fewer dependent loads a row
        m_c = tl.max(tl.where(ci == chunk, m, float("-inf")), 0)
        offs = tl.arange(0, CHUNK)
        x = tl.load(base + chunk * CHUNK + offs, mask=chunk * CHUNK + offs < n_vocab,
                    other=float("-inf")).to(tl.float32)
        j = _pick(tl.exp2((x - m_c) * c2).to(tl.float64), _uniform53(c, d), CHUNK)
        tok = chunk * CHUNK + j
        x_tok = tl.max(tl.where(offs == j, x, float("-inf")), 0)
    tl.store(TOK + row, tok.to(tl.int64))
    # log softmax(x / T)[tok] = (x_tok - max) / T - log(sum of exp((x - max) / T))
    tl.store(LOGP + row, tl.math.div_rn(x_tok - m_all, t) - tl.log(tl.sum(w, 0)))


def cdf_sample(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
               seeds: torch.Tensor, splits: int, num_warps: int,
               chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_sample's "cdf" method (same arguments; chunk a power of two, at least 16)."""
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"fused_sample: chunk={chunk} must be a power of two >= 16")
    b, v = logits.shape
    dev = logits.device
    n_chunks = triton.cdiv(v, chunk)
    ncp = max(16, triton.next_power_of_2(n_chunks))
    stats = torch.empty((3, b, ncp), dtype=torch.float32, device=dev)  # max, sum-exp, argmax
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logp = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, logp
    m, s, arg = stats[0], stats[1], stats[2].view(torch.int32)
    _chunk_stats[(b, min(splits, n_chunks))](
        logits, temperatures, greedy, m, s, arg, v, n_chunks, logits.stride(0), ncp,
        SPLITS=min(splits, n_chunks), CHUNK=chunk, num_warps=num_warps)
    _select[(b,)](logits, seeds, temperatures, greedy, m, s, arg, tokens, logp, v, n_chunks,
                  logits.stride(0), ncp, NCP=ncp, CHUNK=chunk, num_warps=SELECT_WARPS)
    return tokens, logp
