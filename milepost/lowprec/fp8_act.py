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


class SplitSum(NamedTuple):
    """A split-K FP8 linear's output left unsummed for the kernel that reads it next.

    At decode batch sizes the FP8 GEMM splits K over programs to fill the SMs and a second
    launch sums the fp32 parts (kernels/fp8_decode.py): ~2.3 us a call on an H100, three calls a
    layer. qkv_proj's output goes straight into the RoPE + KV store kernel (and, with
    PARTS_TO_NORM, o_proj's and down_proj's into the fused residual add + RMSNorm), which sums
    the parts itself in the same order (0 + part 0 + part 1 + ..., rounded to `dtype`,
    kernels/fused_ops.load_rounded): the same bits, one launch fewer."""

    parts: torch.Tensor  # float32 [split, rows, N], contiguous
    dtype: torch.dtype  # the linear's output dtype

    def summed(self) -> torch.Tensor:
        """The output itself, [rows, N] in `dtype` (the second kernel's sum)."""
        from milepost.kernels.fp8_decode import sum_split_parts

        p = self.parts
        return sum_split_parts(p, torch.empty(p.shape[1:], dtype=self.dtype, device=p.device))


def summed(y: torch.Tensor | SplitSum) -> torch.Tensor:
    """y as a tensor (a SplitSum's parts summed)."""
    return y.summed() if isinstance(y, SplitSum) else y


# o_proj's and down_proj's parts to the fused add + norm too (qkv_proj's always go to the RoPE +
# store kernel). Off: on an H100 (2026-12-07, Qwen3-4B FP8 + FP8 KV, 64 requests) the norm
# reading 6-8 parts of each row took 9.1 us against 3.5 (with the sums apart), and the engine
# ran x0.954 with it on (rope + norm) against every sum its own launch.
PARTS_TO_NORM = False


def unsummed(linear: nn.Module, x: torch.Tensor | Fp8Act) -> torch.Tensor | SplitSum:
    """linear(x), or its split-K parts unsummed where the linear can leave them so (a native
    fp8_block QuantizedLinear without bias or hooks, at a split decode GEMM): for a caller that
    hands the result to a kernel that sums them (paged_attention.rope_store,
    fused_fp8_act.add_rms_norm_fp8)."""
    forward = getattr(type(linear), "forward_unsummed", None)
    if forward is None or linear._forward_hooks or linear._forward_pre_hooks:
        return linear(x)
    return forward(linear, x)
