"""The trainer's FP8 linear on Hopper (issue 23, `--precision fp8`): forward, data-gradient and
weight-gradient GEMMs in FP8, on the GEMMs fp8_gemm.py probes per device (cuBLAS's block-scaled
GEMM, the Triton kernel, or the emulated product)."""

from __future__ import annotations

import torch

from milepost.kernels import fp8_gemm  # its probe's choices, read (and patched in tests) there
from milepost.kernels.fp8_gemm import fp8_block_linear, rows_mm, scaled_mm_block, triton_block_mm
from milepost.kernels.fp8_quant import TILE, quantize_act_1x128
from milepost.kernels.fp8_train_quant import quantize_blocks
from milepost.lowprec.fp8_options import Fp8TrainOptions


class Fp8BlockLinearFn(torch.autograd.Function):
    """The trainer's FP8 linear on Hopper: the three GEMMs in FP8 with the values the emulated
    path (milepost/lowprec/linear.py) uses: forward x (1x128) x W (128x128); data gradient
    gy (1x128 along N) x W^T (the same tiles transposed); weight gradient gy^T x x^T, both
    1x128 along the tokens (zero-padded to a multiple of 128). The weight's gradient goes
    straight through to the master weight. `opts` (kernels/fp8_train_quant.py) picks the
    quantize passes (same values); `wvt`: the weight's values transposed [K, N] where the
    weight quantizer made them, kept for the data gradient instead of `wv`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wv: torch.Tensor, ws: torch.Tensor,
                opts: Fp8TrainOptions | None = None, wvt: torch.Tensor | None = None) -> torch.Tensor:
        opts = opts or Fp8TrainOptions()
        ctx.save_for_backward(x, wv if wvt is None else wvt, ws)
        ctx.opts, ctx.transposed = opts, wvt is not None
        return _train_block_linear(x, wv, ws, opts)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x, w_saved, ws = ctx.saved_tensors
        opts = ctx.opts
        x2, gy2 = x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1]).contiguous()
        wt = w_saved if ctx.transposed else w_saved.t().contiguous()
        gx = _train_block_linear(gy2, wt, ws.t().contiguous(), opts)
        gw = _weight_grad(gy2, x2, gy.dtype, opts)
        return gx.reshape(x.shape), gw, None, None, None, None


def _train_block_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                        opts: Fp8TrainOptions) -> torch.Tensor:
    """fp8_block_linear, with the activation quantized by `quantize_blocks` under act_quant
    "tiled" (M beyond decode sizes: smaller M keep the engines' per-bucket GEMM choice)."""
    shape = x.shape
    m = x.numel() // shape[-1]
    backend = fp8_gemm.block_backend(x.device, m)
    if opts.act_quant == "rows" or backend not in ("scaled_mm", "triton"):
        return fp8_block_linear(x, w, sw)
    xq, sx = quantize_blocks(x.reshape(-1, shape[-1]), 4 if backend == "scaled_mm" else 1)
    fn = scaled_mm_block if backend == "scaled_mm" else triton_block_mm
    return fn(xq, sx, w, sw, x.dtype)[:m].reshape(*shape[:-1], w.shape[0])


def wgrad_backend(device: torch.device) -> str:
    """The weight-gradient GEMM the probe chose for `device` ('scaled_mm' | 'triton' | 'emulated')."""
    fp8_gemm.block_backend(device)
    return fp8_gemm._ROWS[device.index if device.index is not None else torch.cuda.current_device()]


def _weight_grad(gy2: torch.Tensor, x2: torch.Tensor, dtype: torch.dtype,
                 opts: Fp8TrainOptions) -> torch.Tensor:
    """gy2 [T, N], x2 [T, K] -> gy2^T x2 [N, K], both operands 1x128 along the tokens."""
    rows = wgrad_backend(gy2.device)
    # The tokens are the contraction dim here: zero-padded to whole 1x128 blocks (cuBLAS:
    # a multiple of 4 blocks).
    multiple = 4 * TILE if rows == "scaled_mm" else TILE
    if opts.transpose == "fused":  # quantized from the transposed views: no copies
        gq, sg = quantize_blocks(gy2.t(), 1, multiple)
        xq, sx = quantize_blocks(x2.t(), 1, multiple)
    else:
        pad = (-gy2.shape[0]) % multiple
        gq, sg = quantize_act_1x128(torch.nn.functional.pad(gy2.t(), (0, pad)).contiguous())
        xq, sx = quantize_act_1x128(torch.nn.functional.pad(x2.t(), (0, pad)).contiguous())
    return rows_mm(gq, sg, xq, sx, dtype, rows)
