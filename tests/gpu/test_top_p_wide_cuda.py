"""Top-p on CUDA with the wide rows' nucleus on the device (kernels/top_p_wide.py): no host
synchronization in `_nucleus`, the same kept tokens as the host path's full sort, and the same
seeded draws through `sample()`.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_top_p_wide_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

import milepost.engine.sampling as sampling
from milepost.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _flat(rows: int, vocab: int = 151936, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(rows, vocab, device="cuda", generator=g) * 0.5  # flat: wide nuclei


def test_nucleus_needs_no_sync_and_keeps_the_sorted_set() -> None:
    logits = _flat(16)
    probs = torch.softmax(logits, dim=1)
    top_p = torch.linspace(0.3, 0.99, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dev = sampling._nucleus(probs.clone(), top_p)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = sampling._nucleus(probs.clone(), top_p, on_device=False)
    assert int((dev > 0).sum(dim=1).max()) > sampling.TOP_P_CANDIDATES, "no row was wide"
    differ = ((dev > 0) != (host > 0)).sum(dim=1)
    assert int(differ.max()) <= 1, differ.tolist()  # a cut within fp32 rounding moves by one
    assert int((differ > 0).sum()) <= 2


def test_sampled_tokens_equal_the_host_path() -> None:
    logits = _flat(32, seed=1)
    params = [SamplingParams(temperature=1.0, top_p=0.95, sampling_seed=i) for i in range(32)]

    def draw(on_device: bool) -> list[int]:
        gens = [torch.Generator(device="cuda").manual_seed(i) for i in range(32)]
        real = sampling._nucleus
        sampling._nucleus = lambda p, t: real(p, t, on_device=on_device)
        try:
            return sampling.sample(logits.clone(), params, gens, [[] for _ in params]).tokens.tolist()
        finally:
            sampling._nucleus = real

    a, b = draw(True), draw(False)
    assert sum(x != y for x, y in zip(a, b)) <= 1  # a draw may move only where a cut moved
