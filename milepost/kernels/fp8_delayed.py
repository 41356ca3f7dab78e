"""Native FP8 GEMMs of the trainer's delayed-scaling linears (`--fp8-scaling delayed`).

The values are the emulated path's (lowprec/delayed.py `DelayedFp8LinearFn`): input and output
gradient in E4M3 under one float32 scale per tensor (an input with no history yet: its own
1 x 128 blocks), the weight in the shared quantizer's 128 x 128 tiles. Forward (x W^T) and data
gradient (gy W) multiply a per-tensor operand by the weight's tiles: the static engines'
block-scaled GEMM (`static_block_mm`, every block scale the tensor's), so the trainer's forward
is the engines' computation. The weight gradient (gy^T x, summed over the tokens) has two
per-tensor operands: `torch._scaled_mm` with two scalar scales (row-major A, column-major B, the
tokens zero-padded to a multiple of 16). Inputs still in 1 x 128 blocks along the features (the
first step) cannot enter an FP8 GEMM over the tokens: that weight gradient runs dequantized in
the model dtype, as emulated. A tensor whose slot has history is quantized in one Triton pass
that also takes its amax (fp8_quant.py `quantize_tensor_e4m3`). What differs from the emulated
path: the order of the sums, and the emulated operands' rounding to the model dtype (the native
GEMMs scale in fp32).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from milepost.lowprec import elements as el

if TYPE_CHECKING:
    from milepost.lowprec.delayed import DelayedScaling
    from milepost.lowprec.fp8_options import Fp8TrainOptions

log = logging.getLogger(__name__)
TILE = 128
TOKEN_ALIGN = 16  # cuBLAS FP8: every dim of _scaled_mm a multiple of 16
# (block GEMM or None = chosen per M as for the engines, weight-gradient GEMM)
Gemms = tuple[str | None, str]
_NATIVE: dict[int, Gemms | None] = {}  # CUDA device index -> its GEMMs, None = emulated


def quantize_per_tensor(t: torch.Tensor, scale: torch.Tensor, bad: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """t [M, K] -> (float8_e4m3fn [M, K], float32 0-d scale): qdq_per_tensor's elements (the
    same division and cast), the scale NaN where t holds NaN/Inf (NaN out, never a wrong value)."""
    s = torch.where(bad, torch.nan, scale).float()
    return el.to_e4m3(t.detach().float() / s), s


def block_scales(s: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """0-d scale -> [m, k/128] block scales, all equal, M-major (stride 1 along M): the layout
    cuBLAS's block-scaled GEMM reads, so scaled_mm_block needs no copy of the operand."""
    return s.expand(k // TILE, m).contiguous().t()


def quantize_operand(state: DelayedScaling, t2: torch.Tensor, slot: int, record: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """t2 [M, K] as `slot` quantizes it -> (float8 [M, K], float32 block scales [M, K/128],
    whether one scale serves the tensor). With history: one Triton pass (elements, amax, NaN/Inf
    check); a tensor holding NaN/Inf gets a NaN scale, so every product with it is NaN, as
    emulated. The first step's tensors take the torch quantizers (inputs: their 1 x 128 blocks)."""
    from milepost.kernels.fp8_quant import quantize_tensor_e4m3
    from milepost.lowprec.delayed import quantize_input_blocks

    m, k = t2.shape
    if state.seen(slot):
        q, amax, bad = quantize_tensor_e4m3(t2, state.scale[slot])
        if record:
            state.record(slot, amax)
        return q, block_scales(torch.where(bad, torch.nan, state.scale[slot]), m, k), True
    scale, bad = state.operand_scale(t2, slot, record)
    if slot % 2 == 0:  # an input ("x" slots are even), no history: qdq_input with scale 0
        return *quantize_input_blocks(t2, scale), False
    q, s = quantize_per_tensor(t2, scale, bad)
    return q, block_scales(s, m, k), True


def _pad_tokens(q: torch.Tensor, multiple: int) -> torch.Tensor:
    """q [R, T] fp8 -> [R, T'] with T' the next multiple: zero bytes (E4M3 +0) add nothing."""
    pad = (-q.shape[1]) % multiple
    if not pad:
        return q
    return torch.nn.functional.pad(q.view(torch.uint8), (0, pad)).view(q.dtype)


def tensorwise_mm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor,
                  out_dtype: torch.dtype, backend: str = "scaled_mm") -> torch.Tensor:
    """aq [M, T], bq [N, T] (E4M3, row-major) with 0-d float32 scales -> (sa aq)(sb bq)^T
    [M, N] in out_dtype; 'emulated': the fp32 product of the dequantized operands."""
    if backend == "emulated":
        return ((aq.float() * sa) @ (bq.float() * sb).t()).to(out_dtype)
    a, b = _pad_tokens(aq, TOKEN_ALIGN), _pad_tokens(bq, TOKEN_ALIGN)
    return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _probe_tensorwise(device: torch.device) -> bool:
    """Whether `_scaled_mm` with scalar scales gives the emulated product here, on operands
    whose scales are far from 1 and a token count that needs padding."""
    from milepost.kernels.fp8_gemm import _agrees

    gen = torch.Generator(device=device).manual_seed(2)
    a = torch.randn(256, 200, device=device, generator=gen) * 1e3
    b = torch.randn(384, 200, device=device, generator=gen) * 1e-3
    ok = torch.zeros((), dtype=torch.bool, device=device)
    (aq, sa), (bq, sb) = (quantize_per_tensor(t, t.abs().amax() / el.E4M3_MAX, ok) for t in (a, b))
    ref = tensorwise_mm(aq, sa, bq, sb, torch.float32, "emulated")
    try:
        out = tensorwise_mm(aq, sa, bq, sb, torch.bfloat16).float()
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - unsupported by this torch/cuBLAS
        log.warning("fp8 per-tensor GEMM (torch._scaled_mm) not used: %s", str(e).splitlines()[0][:200])
        return False
    if not _agrees(out, ref):
        log.warning("fp8 per-tensor GEMM (torch._scaled_mm): wrong product (max diff %.3g); not used",
                    (out - ref).abs().max().item())
        return False
    return True


def native_gemms(device: torch.device) -> Gemms | None:
    """The delayed linears' FP8 GEMMs on `device`, or None where they run emulated: probed once
    per CUDA device (compute capability >= 8.9, the block GEMM's probe, the per-tensor GEMM's),
    with a warning where a CUDA device falls back. CPU: None (emulated, as documented)."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NATIVE:
        _NATIVE[idx] = _probe(torch.device("cuda", idx))
    return _NATIVE[idx]


def _probe(dev: torch.device) -> Gemms | None:
    cc = torch.cuda.get_device_capability(dev)
    if cc < (8, 9):
        log.warning("--fp8-scaling delayed on cuda:%d (compute capability %d.%d, no FP8 tensor "
                    "cores): the FP8 GEMMs run emulated (dequantized, slow)", dev.index, *cc)
        return None
    from milepost.kernels.fp8_gemm import block_backend

    if block_backend(dev) == "emulated":  # it warned itself
        log.warning("--fp8-scaling delayed on cuda:%d: no block-scaled FP8 GEMM passed its probe; "
                    "the FP8 GEMMs run emulated (dequantized, slow)", dev.index)
        return None
    rows = "scaled_mm" if _probe_tensorwise(dev) else "emulated"
    level = logging.INFO if rows == "scaled_mm" else logging.WARNING
    log.log(level, "--fp8-scaling delayed on cuda:%d: forward and data gradient on the block-scaled "
            "FP8 GEMM, weight gradient %s", dev.index,
            "on torch._scaled_mm (per-tensor scales)" if rows == "scaled_mm" else "emulated (fp32)")
    return None, rows


def runs_native(weight: torch.Tensor, x: torch.Tensor) -> Gemms | None:
    """The GEMMs for a delayed linear of `weight` [N, K] on input `x`, or None (emulated): a CUDA
    device that has them, bf16/fp16 (the GEMMs' output types) and whole 128 x 128 weight tiles."""
    n, k = weight.shape
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or n % TILE or k % TILE:
        return None
    return native_gemms(x.device)


def _dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[M, K] fp8 with [M, K/128] block scales -> values in dtype (quantize_activation's)."""
    return (q.float() * s.repeat_interleave(TILE, 1)).to(dtype)


class DelayedFp8NativeFn(torch.autograd.Function):
    """DelayedFp8LinearFn's values through FP8 GEMMs (see the module docstring); the weight's
    gradient goes straight through to the master weight. `opts` (lowprec/fp8_options.py)
    transpose "fused": a per-tensor operand is quantized with its transposed copy in one pass
    (`quantize_tensor_t`), the forward saving only the transposed input; `wvt`: the weight's
    values transposed, made by the weight quantizer, kept for the data gradient. Same values."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wv: torch.Tensor, ws: torch.Tensor,
                state: DelayedScaling, slots: tuple[int, int], record: bool,
                gemms: Gemms, opts: Fp8TrainOptions | None = None,
                wvt: torch.Tensor | None = None) -> torch.Tensor:
        from milepost.kernels.fp8_gemm import static_block_mm
        from milepost.lowprec.fp8_options import Fp8TrainOptions

        fused = (opts or Fp8TrainOptions()).transpose == "fused"  # None: the defaults
        xq, sx, per_tensor, xqt = _operand(state, x.reshape(-1, x.shape[-1]), slots[0], record, fused)
        ctx.save_for_backward(xq if xqt is None else xqt, sx, wv if wvt is None else wvt, ws)
        ctx.state, ctx.gy_slot, ctx.gemms, ctx.per_tensor = state, slots[1], gemms, per_tensor
        ctx.x_shape, ctx.w_dtype, ctx.fused = x.shape, weight.dtype, fused
        ctx.x_t, ctx.w_t = xqt is not None, wvt is not None
        y = static_block_mm(xq, sx, wv, ws, x.dtype, gemms[0])
        return y.reshape(*x.shape[:-1], wv.shape[0])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        from milepost.kernels.fp8_gemm import static_block_mm

        x_saved, sx, w_saved, ws = ctx.saved_tensors
        gq, sg, _, gqt = _operand(ctx.state, gy.reshape(-1, gy.shape[-1]), ctx.gy_slot, True, ctx.fused)
        # data gradient: contracts over the output features, the weight's tiles transposed
        wt = w_saved if ctx.w_t else w_saved.t().contiguous()
        gx = static_block_mm(gq, sg, wt, ws.t().contiguous(), gy.dtype, ctx.gemms[0])
        if ctx.per_tensor:  # weight gradient: contracts over the tokens, both scales scalars
            a = gqt if gqt is not None else gq.t().contiguous()
            b = x_saved if ctx.x_t else x_saved.t().contiguous()
            gw = tensorwise_mm(a, sg[0, 0].clone(), b, sx[0, 0].clone(), gy.dtype, ctx.gemms[1])
        else:
            gw = _dequantize(gq, sg, gy.dtype).t() @ _dequantize(x_saved, sx, gy.dtype)
        return gx.reshape(ctx.x_shape), gw.to(ctx.w_dtype), None, None, None, None, None, None, None, None


def _operand(state: DelayedScaling, t2: torch.Tensor, slot: int, record: bool, fused: bool
             ) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor | None]:
    """quantize_operand's (values, block scales, per tensor), and the values transposed with the
    tokens padded to TOKEN_ALIGN where `fused` and the slot has history (else None)."""
    if not (fused and state.seen(slot)):
        return *quantize_operand(state, t2, slot, record), None
    from milepost.kernels.fp8_train_quant import quantize_tensor_t

    q, qt, amax, bad = quantize_tensor_t(t2, state.scale[slot], TOKEN_ALIGN)
    if record:
        state.record(slot, amax)
    m, k = t2.shape
    return q, block_scales(torch.where(bad, torch.nan, state.scale[slot]), m, k), True, qt
