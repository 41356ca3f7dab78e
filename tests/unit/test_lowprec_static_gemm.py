"""Static input scales through the block-scaled FP8 GEMMs (a static engine's native path on
Hopper, `fp8_static_linear`): the quantized input and its block scales are `qdq_input`'s values
bit for bit (a static scale, none yet, NaN/Inf), and the Triton GEMM with those scales (all
equal when static) gives the emulated product. Without CUDA the kernel runs under Triton's interpreter.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from milepost.kernels.fp8_gemm import emulated_block_mm, fp8_static_linear, triton_block_mm
from milepost.lowprec.delayed import qdq_input, quantize_input_blocks
from milepost.lowprec.quantize import quantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(2)


def _inputs(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 384, generator=g) * torch.logspace(-3, 3, 20)[:, None]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.37, 0.0])  # static; none yet (each block its own)
def test_blocks_dequantize_to_qdq_input(dtype: torch.dtype, scale: float) -> None:
    x, s = _inputs(dtype), torch.tensor(scale)
    for bad in (None, math.inf):
        if bad is not None:
            x[3, 200] = bad
        xq, sx = quantize_input_blocks(x, s)
        assert xq.dtype == torch.float8_e4m3fn and sx.shape == (20, 3)
        deq = (xq.float() * sx.repeat_interleave(128, 1)).to(dtype)
        want = qdq_input(x, s)
        assert torch.equal(deq.isnan(), want.isnan())
        assert torch.equal(deq.nan_to_num(), want.nan_to_num())


def test_triton_gemm_with_static_scales_equals_the_emulated_product() -> None:
    x = _inputs(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    w = quantize(torch.randn(256, 384, generator=g) * torch.logspace(-1, 1, 384)[None, :], "fp8_block")
    scale = x.float().abs().amax() / 448.0
    xq, sx = quantize_input_blocks(x, scale)
    assert (sx == scale).all()  # one scale for every block
    ref = emulated_block_mm(xq, sx, w.values, w.scales, torch.float32)
    y = triton_block_mm(xq.to(DEV), sx.to(DEV), w.values.to(DEV), w.scales.to(DEV), torch.float32).cpu()
    tol = 1e-5 * ref.abs().amax(1, keepdim=True)
    assert ((y - ref).abs() <= tol).all()
    emulated = fp8_static_linear(x, w.values, w.scales, scale, backend="emulated")
    assert torch.equal(emulated, ref.to(torch.bfloat16))
