"""Stochastic rounding of NVFP4 gradients (`--nvfp4-stochastic-rounding`), the NVFP4 training
recipe's rule: gradients round stochastically, activations and weights to nearest even.

Only the trainer's backward uses it (the output gradient, in both backward GEMMs), so the shared
bit-exact quantizer (quantize.py) is untouched: the scales are that quantizer's (per-token tensor
scale, E4M3 block scales, four-over-six's choice included), and only the E2M1 element rounding
changes: a value v between neighbouring grid points lo < v < hi becomes hi with probability
(v - lo) / (hi - lo), else lo, so E[Q(v)] = v (unbiased) where round-to-nearest is biased toward
the grid. Draws come from torch's generator on the gradient's device (saved and restored with the
trainer's RNG state in checkpoints).
"""

from __future__ import annotations

import torch

from milepost.lowprec import elements as el
from milepost.lowprec.quantize import element_scale, quantize


def round_e2m1_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """float32 `v` (|v| <= 6 after the block scale) rounded to E2M1 up or down, up where the
    uniform draw `u` in [0, 1) falls below the fractional distance to the lower grid point."""
    a = v.abs().clamp(max=el.E2M1_MAX)
    # Index of the grid point lo <= a: the nonzero grid values a reaches, counted with scalar
    # compares (no table copied to the device: elements.py); a = 6 stays in [4, 6] (up: 6).
    below = torch.zeros(a.shape, dtype=torch.int32, device=a.device)
    for g in el.E2M1_VALUES[1:-1]:
        below += a >= g
    lo, hi = el.e2m1_magnitude(below), el.e2m1_magnitude(below + 1)
    span = torch.where(hi > lo, hi - lo, 1.0)
    up = u < (a - lo) / span
    return torch.copysign(torch.where(up, hi, lo), v)


def qdq_nvfp4_stochastic(x: torch.Tensor, four_over_six: bool = False,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` ([.., K], blocks of 16 along K, per-row tensor scale as an activation) quantized to
    NVFP4 with stochastically rounded elements and dequantized back to x's dtype."""
    q = quantize(x, "nvfp4", "activation", four_over_six=four_over_six)
    denom = element_scale(q)  # the float32 product s * g the elements are multiplied by
    xf = x.detach().float()
    v = torch.where(denom > 0, xf / denom, 0.0)
    u = torch.rand(v.shape, generator=generator, device=v.device)
    out = round_e2m1_stochastic(v, u) * denom  # a NaN block keeps its NaN scale: NaN out
    return out.to(x.dtype)
