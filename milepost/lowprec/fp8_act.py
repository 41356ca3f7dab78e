"""An activation already quantized for an FP8 blockwise linear (issue 23, decode speed).

At decode batch sizes each FP8 linear's own activation-quantize launch costs about what its
GEMM does. So on the GPU inference path the kernel that makes a linear's input (the RMSNorm
before q/k/v and gate/up, SiLU * up before down_proj: milepost/kernels/fused_fp8_act.py) also
writes its 1 x 128-block FP8 values and scales, exactly `quantize_act_1x128`'s bits, and hands
the linear this `Fp8Act` instead of the model-dtype tensor. Only a linear that says it takes one
(`takes_fp8_act`: a native fp8_block QuantizedLinear with the fusion on and no hooks reading its
input) is handed one; every other consumer, and the bf16 path, gets the tensor as before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Fp8Act(NamedTuple):
    """`quantize_act_1x128(x, 4)` of a [rows, K] activation x, made where x was made."""

    values: torch.Tensor  # float8_e4m3fn [Mp, K]: Mp = rows rounded up to 4, padding rows 0
    scales: torch.Tensor  # float32 [Mp, K/128], M-major (stride (1, Mp)); padding rows 1
    rows: int  # the activation's rows (M)
    dtype: torch.dtype  # the activation's dtype: the linear's output dtype


PAD_ROWS = 4  # cuBLAS's block-scaled GEMM takes the rows padded to 4 (fp8_gemm.scaled_mm_block)


def takes_fp8_act(linear: nn.Module | None) -> bool:
    """Whether `linear` is to be handed an Fp8Act instead of its input tensor (asks the
    module's class, so a plain nn.Linear costs one attribute lookup on its type)."""
    takes = getattr(type(linear), "takes_fp8_act", None)
    return takes is not None and bool(takes(linear))
