"""Stochastic rounding of NVFP4 gradients (`--nvfp4-stochastic-rounding`): unbiased where
round-to-nearest is not, each draw on the format's grid with the shared quantizer's scales, and
the trainer's backward (only) uses it."""

from __future__ import annotations

import torch
from torch import nn

from milepost.lowprec.contract import Contract
from milepost.lowprec.linear import apply_train_precision, qdq
from milepost.lowprec.quantize import element_scale, quantize
from milepost.lowprec.stochastic import qdq_nvfp4_stochastic

torch.set_num_threads(1)


def test_unbiased_on_the_grid_with_the_shared_scales() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-3, 1, 8)[:, None]  # per-token ranges
    draws = 4096
    rows = qdq_nvfp4_stochastic(x.repeat(draws, 1), generator=g).reshape(draws, *x.shape)
    denom = element_scale(quantize(x, "nvfp4", "activation"))
    # Every draw is one of the two grid points around x / denom (times the same scale).
    v = x / denom
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    i = torch.searchsorted(grid, v.abs().clamp(max=6.0).contiguous(), right=True).clamp(1, 7) - 1
    lo, hi = grid[i], grid[(i + 1).clamp(max=7)]
    got = rows.abs()
    assert ((got == lo * denom) | (got == hi * denom)).all()
    # Unbiased: the mean of the draws sits within 5 standard errors of x, element by element
    # (a Bernoulli between lo and hi has std <= (hi - lo) / 2). Not where the E4M3 block scale,
    # rounded down, puts a block's largest values past 6: those saturate, as under nearest.
    inside = v.abs() <= 6.0
    assert inside.float().mean() > 0.95
    stderr = (hi - lo).clamp(min=1e-12) * denom / 2 / draws**0.5
    err = rows.mean(0) - x
    assert (err.abs() <= 5 * stderr + 1e-7)[inside].all()
    # Round-to-nearest is biased: its error, a fixed function of x, dwarfs the SR mean's.
    rne = qdq(x, "nvfp4") - x
    assert err[inside].abs().mean() < rne[inside].abs().mean() / 10
    z = (err / stderr.clamp(min=1e-12))[(hi > lo) & inside]
    assert z.mean().abs() < 0.2  # no drift in aggregate either (z mean over ~500 elements)


def test_only_the_backward_rounds_stochastically() -> None:
    torch.manual_seed(1)
    lin = nn.Linear(64, 32, bias=False)
    ref = nn.Linear(64, 32, bias=False)
    ref.load_state_dict(lin.state_dict())
    for m, sr in ((lin, True), (ref, False)):
        holder = nn.Module()
        holder.model = nn.Module()
        holder.model.layers = nn.ModuleList([nn.Module()])
        holder.model.layers[0].mlp = nn.Module()
        holder.model.layers[0].mlp.up_proj = m
        apply_train_precision(holder, Contract("nvfp4", "nvfp4"), stochastic_rounding=sr)
    x = torch.randn(16, 64)
    gy = torch.randn(16, 32)
    grads = []
    for _ in range(2):
        xr = x.clone().requires_grad_()
        y = lin(xr)
        assert torch.equal(y, ref(x))  # forward: round-to-nearest, the engines' values
        y.backward(gy)
        grads.append(xr.grad)
    assert not torch.equal(grads[0], grads[1])  # fresh draws each backward
    xr = x.clone().requires_grad_()
    ref(xr).backward(gy)
    exact = gy @ lin.quantized_weight()
    # Both near the exact product; the SR average over two draws is already no worse.
    assert (grads[0] - exact).norm() < 0.5 * exact.norm()
