"""The fp8 weight format the engine can store (`--quantization fp8`) and its error bound.

float8_e4m3fn values with one float32 scale per output row (scale = row amax / 448). Shared by
the engine (milepost/engine/weight_fp8.py quantizes on arrival) and the trainer's equality check
(milepost/weights/verify.py admits `fp8_error_bound` instead of bit-exact equality).
"""

from __future__ import annotations

import torch

from milepost.lowprec.elements import to_e4m3

FP8 = torch.float8_e4m3fn
FORMAT = "fp8_e4m3_row"  # how /weights_checksum names the format of a quantized tensor
_FP8_INFO = torch.finfo(FP8)


def quantize_rows(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scale per row) of a 2-d tensor: src ~ values * scale[:, None]."""
    if src.dim() != 2:
        raise ValueError(f"fp8 row quantization needs a 2-d weight, got shape {list(src.shape)}")
    x = src.detach().float()
    amax = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    # An all-zero row gets the smallest scale: its values quantize to exact zeros.
    scale = (amax / _FP8_INFO.max).clamp(min=torch.finfo(torch.float32).tiny)
    values = to_e4m3(x / scale[:, None])  # saturating; one NaN code on every device
    return values, scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 weights of fp8 `values` with per-row `scale`."""
    return values.float() * scale.float()[:, None]


def fp8_error_bound(sent: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequantized - sent| for a row quantized with `scale`.

    Round to nearest in e4m3 costs at most half a unit in the last place: eps/2 of the value
    (eps = 2^-3, three mantissa bits) for normal values, and half the subnormal step
    (smallest_normal * eps / 2 = 2^-10) below 2^-6, both in units of the row's scale. The last
    factor covers the float32 division and product around the rounding (2^-24 each).
    """
    half_ulp = _FP8_INFO.eps / 2
    subnormal = _FP8_INFO.smallest_normal * _FP8_INFO.eps / 2
    x = sent.detach().float()
    # scale: one per row, shaped like sent less its last dim (a stacked [E, rows, cols] expert
    # tensor has [E, rows]).
    return (half_ulp * x.abs() + subnormal * scale.float()[..., None]) * (1 + 2.0**-20)
