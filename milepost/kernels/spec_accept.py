"""The speculative verifier's bookkeeping in two small kernels, one program per request.

`engine/speculative_sampling.launch_verify` finds each request's accepted prefix (the proposals
before its first rejection) and then the tokens it keeps with their log-probs. In torch ops that
was ~18 launches a step (a padded proposals matrix, a cumulative product, gathers, a cat), each
a few microseconds of host dispatch; a speculative step is host-bound at small batches (on an
H100 its Python and dispatch were ~2/3 of a 2.6 ms step, session 32), so these do the same in two:

- `accepted`: per request, m = the number of leading proposals that passed (given flags `ok`,
  or, for a batch of greedy requests, proposal == the row's argmax), and the row it ends on;
- `kept`: per request, [m, its m accepted proposals, the final token, padding] and the target's
  log-prob of each kept token (the final token: given, or the argmax at the last row).

Both give the torch path's values exactly (integer work and one gather);
tests/unit/test_spec_accept.py compares them under Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accepted_kernel(OK, TOKS, ARGMAX, OFFS, LENS, STARTS, M, LAST,
                     HAS_OK: tl.constexpr, KP: tl.constexpr):
    i = tl.program_id(0)
    off = tl.load(OFFS + i)
    n = tl.load(LENS + i)
    start = tl.load(STARTS + i)
    j = tl.arange(0, KP)
    inside = j < n
    if HAS_OK:
        passed = tl.load(OK + off + j, mask=inside, other=0) != 0
    else:  # greedy: a proposal passes where it is the argmax of the row before it
        passed = tl.load(ARGMAX + start + j, mask=inside, other=-1) == tl.load(
            TOKS + off + j, mask=inside, other=-2)
    m = tl.minimum(tl.min(tl.where(passed & inside, KP, j), axis=0), n)  # the first failure
    tl.store(M + i, m)
    tl.store(LAST + i, start + m)


@triton.jit
def _kept_kernel(M, TOKS, OFFS, STARTS, FINAL, ARGMAX, LP_ALL, stride_lp, INTS, LP,
                 HAS_FINAL: tl.constexpr, WIDTH: tl.constexpr, KP1: tl.constexpr):
    i = tl.program_id(0)
    m = tl.load(M + i)
    off = tl.load(OFFS + i)
    start = tl.load(STARTS + i)
    if HAS_FINAL:
        final = tl.load(FINAL + i)
    else:
        final = tl.load(ARGMAX + start + m)
    j = tl.arange(0, KP1)
    inside = j < WIDTH
    tok = tl.where(j < m, tl.load(TOKS + off + j, mask=j < m, other=0), final)
    row = start + tl.minimum(j, m)
    lp = tl.load(LP_ALL + row.to(tl.int64) * stride_lp + tok, mask=inside, other=0.0)
    base = i.to(tl.int64) * (WIDTH + 1)
    tl.store(INTS + base, m)
    tl.store(INTS + base + 1 + j, tok, mask=inside)
    tl.store(LP + i.to(tl.int64) * WIDTH + j, lp, mask=inside)


def accepted(ok: torch.Tensor | None, toks: torch.Tensor, argmax: torch.Tensor, offs: torch.Tensor,
             lens: torch.Tensor, starts: torch.Tensor, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(m [n], last row [n]) int64. ok: [P] flags of every proposal (request by request), or None
    for greedy requests only (then proposal == argmax of its row); toks [P]; argmax [R]; offs,
    lens, starts [n]: each request's first proposal, proposal count and first logits row."""
    n = lens.numel()
    m = torch.empty(n, dtype=torch.long, device=lens.device)
    last = torch.empty_like(m)
    toks = _not_empty(toks)
    if n:
        _accepted_kernel[(n,)](ok if ok is not None else toks, toks, argmax, offs, lens, starts,
                               m, last, HAS_OK=ok is not None,
                               KP=max(2, triton.next_power_of_2(max(kmax, 1))))
    return m, last


def kept(m: torch.Tensor, final: torch.Tensor | None, toks: torch.Tensor, argmax: torch.Tensor,
         offs: torch.Tensor, starts: torch.Tensor, logprobs_all: torch.Tensor, kmax: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ints [n, kmax + 2] int64: m then the kept tokens, padded with the final one;
    log-probs [n, kmax + 1] fp32 of the kept tokens, at rows start .. start + m). final: [n] the
    token drawn at the last row, or None: the argmax there (greedy requests only)."""
    n = m.numel()
    width = kmax + 1
    ints = torch.empty(n, width + 1, dtype=torch.long, device=m.device)
    lp = torch.empty(n, width, dtype=logprobs_all.dtype, device=m.device)
    toks = _not_empty(toks)
    if n:
        assert logprobs_all.stride(1) == 1
        _kept_kernel[(n,)](m, toks, offs, starts, final if final is not None else m, argmax,
                           logprobs_all, logprobs_all.stride(0), ints, lp,
                           HAS_FINAL=final is not None, WIDTH=width,
                           KP1=max(2, triton.next_power_of_2(width)))
    return ints, lp


def _not_empty(t: torch.Tensor) -> torch.Tensor:
    """No proposal at all: a one-element stand-in (never read: every load of it is masked), since
    an empty CUDA tensor may have no address to pass."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)
