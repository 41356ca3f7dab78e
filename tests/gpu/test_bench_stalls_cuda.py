"""bench.stalls sees a real Triton compile: a new specialization of an integer argument (divisible
by 16 or not) compiles again, a launch of a known one does not.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_bench_stalls_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from milepost.bench.stalls import StallWatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_each_new_specialization_is_one_compile() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _fill(X, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.zeros((BLOCK,), tl.float32) + n, mask=offs < n)

    x = torch.empty(64, device="cuda")
    with StallWatch() as watch:
        for n in (17, 18, 32, 48, 19):  # 17, 18, 19: one class; 32, 48: divisible by 16
            _fill[(1,)](x, n, BLOCK=64)
        torch.cuda.synchronize()
    compiles = [s for s in watch.events if s.what.startswith("compile ")]
    assert len(compiles) == 2, compiles
    assert all("_fill(" in s.what for s in compiles)  # a local kernel: its qualified name
    assert x[:19].eq(19).all()
