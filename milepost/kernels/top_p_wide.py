"""The top-p nucleus of rows whose nucleus spills past the sampler's sorted candidates, on the device.

`engine/sampling._nucleus` sorts only each row's `TOP_P_CANDIDATES` most likely tokens; a row whose
nucleus reaches past them ("wide": a flat distribution at a high temperature) needs all its tokens
ordered. Finding those rows on the host was a `.tolist()` every top-p step, which waits for the
step's forward and so undid the overlap schedule (engine/stepping.py) for every batch with a top-p
request. This kernel takes the wide flags on the device instead: one program per row, which
returns at once for a row that is not wide, and otherwise finds the nucleus without sorting:

- the nucleus keeps tokens in descending order while the mass before them is below
  `limit = top_p * row mass`; with S(v) the mass of the tokens above v, its last value tau is the
  smallest token value with S(tau) < limit (S only steps at token values). tau is searched over
  the bit patterns of non-negative fp32 numbers (which order as the numbers do): each pass over
  the row sums the tokens above PIVOTS evenly spaced patterns at once and keeps the one interval
  between them where S crosses the limit, so the 2^31 patterns take ~31 / log2(PIVOTS + 1)
  passes (PIVOTS = 1 is bisection: 31 passes, each a read of the row from memory);
- every token above tau is kept, and of the tokens equal to tau the first c by index, c the
  number of ties t = 0, 1, ... with S(tau) + t * tau < limit (the order among equal values is the
  one a sort leaves unspecified; here it is the index order).

The row mass sums in another order than torch's cumsum, so where the boundary sits within float
rounding of `limit` the kept count may differ by one token from a sort's; otherwise the kept set
is the sort's. Bisection cost a wide row ~33 reads of it (~20 MB at 151,936 tokens, from HBM when
256 rows are wide: they do not fit in L2 together), each a loop of dependent loads in one
program; on an H100 a top-p step with every row wide took ~3x a plain step (12.2 against 4.1 ms,
2026-12-07). With 7 pivots a row is read ~13 times, in longer iterations: the kernel 2.96x
faster there (with 15 pivots, 2.44x, the step took 8.87 ms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens a loop iteration of the tie pass reads
# Measured on an H100 (benchmarks/top_p_wide_gpu.py, 256 flat rows x 151,936, session 32):
# bisection (1 pivot, 1,024 tokens an iteration, 4 warps) 3,212 us; 1 pivot at 8,192 tokens 1,754;
# 3 pivots at 2,048 1,344; 15 at 1,024 1,315, at 2,048 1,713; 7 at 2,048 with 8 warps 1,084 (x2.96).
PIVOTS = 7  # patterns a search pass tests (2^n - 1: the interval splits into 2^n equal parts)
SEARCH_BLOCK = 2048  # tokens a search iteration reads (x PIVOTS sums in registers)
NUM_WARPS = 8


@triton.jit
def _mass_above(P, V, v, BLOCK: tl.constexpr):
    """Sum of the row's values strictly above v."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(P + offs, mask=offs < V, other=0.0)
        acc += tl.where(p > v, p, 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _masses_above(P, V, piv, BLOCK: tl.constexpr, NP: tl.constexpr):
    """[NP] sums of the row's values strictly above each of the values piv [NP]."""
    acc = tl.zeros((BLOCK, NP), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        p = tl.load(P + offs, mask=offs < V, other=0.0)[:, None]
        acc += tl.where(p > piv[None, :], p, 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _nucleus_wide_kernel(PROBS, OUT, LIMIT, WIDE, V, stride_p, stride_o, BLOCK: tl.constexpr,
                         PIVOTS: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if tl.load(WIDE + row) == 0:
        return
    P = PROBS + row.to(tl.int64) * stride_p
    O = OUT + row.to(tl.int64) * stride_o
    limit = tl.load(LIMIT + row)
    # Search the bit patterns [0, +inf) for the smallest v with S(v) < limit: an answer lies in
    # [lo, hi] (S(hi) < limit), and each pass tests the pivots m_j = lo + (hi - lo) * j / (P + 1),
    # j = 1 .. P. S falls as v grows, so the c pivots with S >= limit are the first c: the answer
    # lies above m_c (or is lo, c = 0) and at most m_(c+1) (m_(P+1) = hi).
    lo = tl.full((), 0, tl.int64)
    hi = tl.full((), 0x7F800000, tl.int64)  # +inf: nothing is above it, S = 0 < limit
    NP: tl.constexpr = PIVOTS + 1  # a power of two for the register tile (the last lane unused)
    j = tl.arange(0, NP)
    while lo < hi:
        m = lo + ((hi - lo) * (j + 1)) // NP  # j = PIVOTS: m = hi, S(hi) < limit (not counted)
        s = _masses_above(P, V, m.to(tl.int32).to(tl.float32, bitcast=True), SEARCH_BLOCK, NP)
        c = tl.sum(((s >= limit) & (j < PIVOTS)).to(tl.int64), axis=0)
        lo_next = tl.where(c == 0, lo, lo + ((hi - lo) * c) // NP + 1)
        hi = lo + ((hi - lo) * (c + 1)) // NP
        lo = lo_next
    tau = hi.to(tl.int32).to(tl.float32, bitcast=True)
    above = _mass_above(P, V, tau, BLOCK)
    # The first c of the tokens equal to tau (by index) are kept: S(tau) + t * tau < limit
    # (tau = 0 only by rounding at top_p = 1: zero-mass tokens, kept or not alike).
    c = tl.minimum(tl.ceil((limit - above) / tl.maximum(tau, 1e-38)), V).to(tl.int32)
    ties = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < V
        p = tl.load(P + offs, mask=inside, other=0.0)
        tied = (p == tau) & inside
        rank = ties + tl.cumsum(tied.to(tl.int32), axis=0) - 1  # the tie's index among all ties
        keep = (p > tau) | (tied & (rank < c))
        tl.store(O + offs, tl.where(keep, p, 0.0), mask=inside)
        ties += tl.sum(tied.to(tl.int32), axis=0)


def nucleus_wide_(probs: torch.Tensor, out: torch.Tensor, limit: torch.Tensor,
                  wide: torch.Tensor) -> None:
    """out[i] = the top-p nucleus of probs[i] (other tokens 0) for every row with wide[i];
    other rows of out are left as they are. probs, out: [r, V] fp32; limit: [r] fp32; wide: [r]
    bool. Nothing is read back to the host."""
    r, v = probs.shape
    if r == 0:
        return
    assert probs.dtype == out.dtype == torch.float32 and probs.stride(1) == out.stride(1) == 1
    _nucleus_wide_kernel[(r,)](probs, out, limit.float().contiguous(), wide.to(torch.int8),
                               v, probs.stride(0), out.stride(0), BLOCK=BLOCK, PIVOTS=PIVOTS,
                               SEARCH_BLOCK=SEARCH_BLOCK, num_warps=NUM_WARPS)
