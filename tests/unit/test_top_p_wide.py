"""The device-side nucleus of wide top-p rows (milepost/kernels/top_p_wide.py) under Triton's
interpreter on CPU: the kept set equals a full stable sort's (ties by index) in fp64, except where
the cut sits within float rounding of the limit; rows not flagged wide are left untouched."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import (conftest sets it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from milepost.engine.sampling import _nucleus  # noqa: E402
from milepost.kernels.top_p_wide import nucleus_wide_  # noqa: E402
from milepost.testing.hopper_compile import needs_ptxas, run_compiled  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(probs: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept mask by a full stable sort in fp64 (ties in index order), and each row's gap between
    the limit and the mass before its last kept / first dropped token (how close the cut is)."""
    p = probs.double()
    limit = top_p.double() * p.sum(dim=1)
    vals, ids = p.sort(dim=1, descending=True, stable=True)
    before = vals.cumsum(dim=1) - vals
    keep_sorted = before < limit[:, None]
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(p, dtype=torch.bool).scatter_(1, ids, keep_sorted)
    gap = (before - limit[:, None]).abs().min(dim=1).values / p.sum(dim=1)
    return keep, gap


def rows(seed: int, n: int, vocab: int, ties: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 0.3  # flat: the nucleus is wide
    if ties:  # bf16-like: few distinct values, many ties at every cut
        logits = (logits * 8).round() / 8
    return torch.softmax(logits, dim=1)


@pytest.mark.parametrize("pivots", [1, 15])
@pytest.mark.parametrize("ties", [False, True])
def test_wide_rows_keep_the_sorted_nucleus(ties: bool, pivots: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any pivot count (1: bisection) finds the sorted nucleus."""
    import milepost.kernels.top_p_wide as kernel

    monkeypatch.setattr(kernel, "PIVOTS", pivots)
    vocab = 2500  # three blocks of 1024, the last one partial
    probs = rows(1 + ties, 6, vocab, ties)
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.2, 0.75, 0.999])
    limit = (top_p * probs.sum(dim=1)).float()
    out = torch.full_like(probs, -1.0)
    wide = torch.tensor([True, True, True, True, False, True])
    nucleus_wide_(probs.to(DEV), out_dev := out.to(DEV), limit.to(DEV), wide.to(DEV))
    out = out_dev.cpu()
    want, gap = reference(probs, top_p)
    assert (out[4] == -1.0).all(), "a row not flagged wide was written"
    assert int((out[2] > 0).sum()) > 1024, "top_p 0.99 of a flat row reaches past 1,024 candidates"
    for i in (0, 1, 2, 3, 5):
        got = out[i] > 0
        assert torch.equal(out[i][got], probs[i][got]), "kept tokens keep their mass"
        differ = int((got != want[i]).sum())
        if differ:  # only a cut within fp32 rounding of the limit may move, by one token
            assert differ == 1 and gap[i] < 1e-6, (i, differ, float(gap[i]))


def test_sampler_nucleus_on_the_device_path_matches_the_host_path() -> None:
    """_nucleus (engine/sampling.py) with the candidates cut to 16 so every row is wide: the
    device kernel's result equals the host path's full sort wherever the cut is not a tie."""
    import milepost.engine.sampling as sampling

    probs = rows(7, 5, 700, ties=False)
    top_p = torch.tensor([0.3, 0.6, 0.9, 0.95, 0.05])
    old = sampling.TOP_P_CANDIDATES
    sampling.TOP_P_CANDIDATES = 16
    try:
        host = _nucleus(probs.clone(), top_p)
        dev = sampling._nucleus(probs.clone().to(DEV), top_p.to(DEV), on_device=True).cpu()
    finally:
        sampling.TOP_P_CANDIDATES = old
    _, gap = reference(probs, top_p)
    for i in range(5):
        if gap[i] > 1e-6:
            assert torch.equal(host[i], dev[i]), i


_COMPILE = """
from milepost.kernels.top_p_wide import BLOCK, NUM_WARPS, PIVOTS, SEARCH_BLOCK, _nucleus_wide_kernel
from milepost.testing.hopper_compile import compile_sm90

ptrs = dict(PROBS="*fp32", OUT="*fp32", LIMIT="*fp32", WIDE="*i8")
k = compile_sm90(_nucleus_wide_kernel, ptrs, dict(BLOCK=BLOCK, PIVOTS=PIVOTS, SEARCH_BLOCK=SEARCH_BLOCK), NUM_WARPS, 1)
assert k.asm["cubin"]
"""


@needs_ptxas()
def test_compiles_for_sm90() -> None:
    run_compiled(_COMPILE)
