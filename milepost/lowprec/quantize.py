"""The one quantizer: FP8 blockwise, MXFP8 and NVFP4, quantize / dequantize / error bound.

Trainer (emulated or native GEMMs), engine (weights stored quantized, re-quantized on every
update), checkpoint conversion and the live weight export all call `quantize` here, so the four
stages see bit-identical values. Blocks run along the last (contraction) dim; FP8 weights use
128 x 128 tiles (DeepSeek-V3 style; a partial edge tile gets its own scale, as those checkpoints
do). MXFP8 and NVFP4 need the last dim to divide their block (32, 16): other shapes are refused
naming the tensor. A block holding NaN or +-Inf dequantizes to NaN in every format (its scale
is NaN), never to a silently wrong finite value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from milepost.lowprec import elements as el
from milepost.lowprec.formats import (  # noqa: F401  (names and block shapes: formats.py)
    FORMATS,
    FP8_TILE,
    INT4_GROUP,
    MX_BLOCK,
    NVFP4_BLOCK,
    Format,
    Role,
    block_shape,
)

# Four-over-six scales some blocks to 4: its tensor scale maps the tensor's amax to 6 * 256, so a
# block scaled to 4 (1.5x larger block scale) still fits E4M3's 448.
_NVFP4_SCALE_MAX = {False: el.E4M3_MAX, True: 256.0}


@dataclass
class QTensor:
    """A quantized tensor. values: float8_e4m3fn [.., K] (fp8_block, mxfp8) or uint8 [.., K/2]
    (nvfp4, two E2M1 codes a byte; int4, two's-complement nibbles, [.., ceil(K/2)]); scales:
    float32 per tile (fp8_block, int4: [rows, ceil(K/128)]), uint8 UE8M0 codes
    (mxfp8) or float8_e4m3fn (nvfp4), one per block; tensor_scale: nvfp4's float32 outer scale
    ([] per tensor, [rows, 1] per token); tile: the block shape (rows, cols); zeros: int4 with
    zero points only (AWQ, asymmetric GPTQ checkpoints served as stored): int8 [rows, ceil(K/128)],
    each group's zero point minus 8, subtracted from the signed value before scaling, so an
    element is (v - zero) * scale (None: symmetric, every zero 0). The quantizer makes none."""

    fmt: str
    values: torch.Tensor
    scales: torch.Tensor
    tile: tuple[int, int]
    shape: tuple[int, ...]
    tensor_scale: torch.Tensor | None = None
    zeros: torch.Tensor | None = None


def check_shape(fmt: str, shape: tuple[int, ...], name: str = "tensor") -> None:
    """Refuse a shape the format cannot hold, naming the tensor and the block."""
    if len(shape) < 1 or (len(shape) < 2 and fmt == "fp8_block"):
        raise ValueError(f"{name}: {fmt} needs a matrix, got shape {list(shape)}")
    block = block_shape(fmt, "activation")[1]
    if fmt in ("mxfp8", "nvfp4") and shape[-1] % block:
        raise ValueError(f"{name}: {fmt} blocks of {block} along the last dim, which is "
                         f"{shape[-1]} (shape {list(shape)}); keep this tensor in bf16 with a "
                         f"precision override or pad it to a multiple of {block}")


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c, correctly rounded on every device. CUDA turns a Python-number (or CPU-scalar)
    divisor into a multiply by its reciprocal, which differs from the CPU's division in the
    last bit for some values: divide by a tensor on x's device instead."""
    return x / torch.full_like(x, c)


def _tiles(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """[R, C] -> [R/tr, C/tc, tr*tc] of zero-padded tiles."""
    tr, tc = tile
    r, c = x.shape
    x = torch.nn.functional.pad(x, (0, -c % tc, 0, -r % tr))
    rb, cb = x.shape[0] // tr, x.shape[1] // tc
    return x.reshape(rb, tr, cb, tc).permute(0, 2, 1, 3).reshape(rb, cb, tr * tc)


def _untile(t: torch.Tensor, tile: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    rb, cb, _ = t.shape
    tr, tc = tile
    return t.reshape(rb, cb, tr, tc).permute(0, 2, 1, 3).reshape(rb * tr, cb * tc)[:rows, :cols]


def _block_amax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax of each tile's finite values, whether the tile holds NaN/Inf)."""
    finite = torch.isfinite(t)
    return torch.where(finite, t.abs(), 0.0).amax(-1), ~finite.all(-1)


def quantize(x: torch.Tensor, fmt: str, role: Role = "weight", *, four_over_six: bool = False,
             name: str = "tensor", outer_amax: torch.Tensor | None = None) -> QTensor:
    """Quantize `x` ([.., K]; fp8_block weights 2-d) in `fmt`. nvfp4 weights get one tensor
    scale, activations one per token (row), so a token's values do not depend on its batch;
    `outer_amax` (nvfp4 weights) sets the tensor scale from several tensors' amax (gate + up)."""
    check_shape(fmt, tuple(x.shape), name)
    tile = block_shape(fmt, role)
    shape = tuple(x.shape)
    t = _tiles(x.detach().float().reshape(-1, shape[-1]), tile)  # [Rb, Cb, block]
    amax, bad = _block_amax(t)
    if fmt == "fp8_block":
        scale = torch.where(amax > 0, _div(amax, el.E4M3_MAX), 1.0)
        scale = torch.where(bad, torch.nan, scale)
        values = el.to_e4m3(t / scale[..., None])
        return QTensor(fmt, _untile(values.view(torch.uint8), tile, *x.reshape(-1, shape[-1]).shape)
                       .contiguous().view(el.E4M3).reshape(shape), scale, tile, shape)
    if fmt == "int4":  # round(x / (amax / 7)) to even, in -8..7; a partial last group is fine
        scale = torch.where(bad, torch.nan, torch.where(amax > 0, _div(amax, 7.0), 1.0))
        v = torch.round(t / scale[..., None]).clamp(-8, 7).nan_to_num(0.0).to(torch.int8)
        ints = _untile(v, tile, *x.reshape(-1, shape[-1]).shape).reshape(shape)
        return QTensor(fmt, el.pack_int4(ints), scale, tile, shape)  # two a byte
    if fmt == "mxfp8":
        # OCP MX 1.0, 6.3: X = 2^(floor(log2 amax) - emax_elem), emax_elem = 8 for E4M3.
        _, exp = torch.frexp(amax)
        e = torch.where(amax > 0, exp - 1 - 8, -el.E8M0_BIAS).clamp(-el.E8M0_BIAS, el.E8M0_BIAS)
        codes = torch.where(bad, el.E8M0_NAN, e + el.E8M0_BIAS).to(torch.uint8)
        values = el.to_e4m3(t * el.e8m0_decode(codes).reciprocal()[..., None])  # 1/2^e: exact
        return QTensor(fmt, values.reshape(shape), codes.reshape(*shape[:-1], -1), tile, shape)
    if outer_amax is None:
        outer_amax = amax.amax() if role == "weight" else amax.amax(-1, keepdim=True)  # tensor | token
    return _quantize_nvfp4(t, amax, bad, role, four_over_six, shape, outer_amax.float())


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of `x` (float32 scalar; 0 for none)."""
    x = x.detach().float()
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax() if x.numel() else x.new_zeros(())


def _quantize_nvfp4(t: torch.Tensor, amax: torch.Tensor, bad: torch.Tensor, role: Role,
                    four_over_six: bool, shape: tuple[int, ...], outer: torch.Tensor) -> QTensor:
    scale_max = _NVFP4_SCALE_MAX[four_over_six]
    g = torch.where(outer > 0, _div(outer, el.E2M1_MAX * scale_max), 1.0)  # the FP32 outer scale

    def attempt(top: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = el.to_e4m3(_div(amax, top) / g)  # the block's E4M3 scale
        denom = s.float() * g  # one float32 product, the same in dequantize
        q = el.round_e2m1(torch.where(denom[..., None] > 0, t / denom[..., None], 0.0))
        return s, q, q * denom[..., None]

    s, q, deq = attempt(el.E2M1_MAX)
    if four_over_six:  # keep 4 where it quantizes the block with a smaller squared error
        s4, q4, deq4 = attempt(4.0)
        use4 = ((deq4 - t) ** 2).sum(-1) < ((deq - t) ** 2).sum(-1)
        s, q = torch.where(use4, s4.float(), s.float()).to(el.E4M3), torch.where(use4[..., None], q4, q)
    s = torch.where(bad, torch.nan, s.float()).to(el.E4M3)
    codes = el.e2m1_codes(q).reshape(shape)
    tensor_scale = g if role == "weight" else g.reshape(*shape[:-1], 1)
    return QTensor("nvfp4", el.pack_nibbles(codes), s.reshape(*shape[:-1], -1),
                   (1, NVFP4_BLOCK), shape, tensor_scale)


def element_scale(q: QTensor) -> torch.Tensor:
    """The float32 scale each element is multiplied by on dequantization, shaped like q."""
    if q.fmt in ("fp8_block", "int4"):
        return _per_element(q.scales, q)
    block = q.tile[1]
    if q.fmt == "mxfp8":
        s = el.e8m0_decode(q.scales)
    else:
        s = q.scales.float() * q.tensor_scale  # the same product the quantizer divided by
    return s.repeat_interleave(block, -1)


def _per_element(t: torch.Tensor, q: QTensor) -> torch.Tensor:
    """A per-tile tensor of `q` (fp8_block / int4 scales, int4 zeros) broadcast over its tiles."""
    tr, tc = q.tile
    s = t.repeat_interleave(tr, 0).repeat_interleave(tc, 1)
    rows = math.prod(q.shape[:-1])  # 1 for a vector
    return s[:rows, :q.shape[-1]].reshape(q.shape)


def dequantize(q: QTensor) -> torch.Tensor:
    """float32 values of `q` (int4 with zero points: (v - zero) * scale, the difference of two
    small integers exact in float32, so one rounding, in the product, as without them)."""
    if q.fmt == "nvfp4":
        v = el.e2m1_decode(el.unpack_nibbles(q.values)).reshape(q.shape)
    elif q.fmt == "int4":
        v = el.unpack_int4(q.values, q.shape[-1]).float()
        if q.zeros is not None:
            v = v - _per_element(q.zeros.float(), q)
    else:
        v = q.values.float()
    return v * element_scale(q)


def error_bound(fmt: str, sent: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(sent)) - sent| given each element's dequant
    `scale` (element_scale): half a unit in the last place of the element format, half its
    subnormal step, and what saturation clips (MX and NVFP4 blocks can map amax past the
    largest element). The last factor covers the float32 divisions and products (2^-24 each)."""
    x = sent.detach().float().abs()
    s = scale.float()
    if fmt == "int4":  # a uniform grid: half a step, no saturation (amax maps to 7 exactly)
        return 0.5 * s * (1 + 2.0**-20) + x * 2.0**-22
    if fmt == "nvfp4":
        half_ulp, half_sub, top = 2.0**-2, 0.25, el.E2M1_MAX
    else:  # E4M3: 3 mantissa bits, subnormal step 2^-9
        half_ulp, half_sub, top = 2.0**-4, 2.0**-10, el.E4M3_MAX
    return (half_ulp * x + half_sub * s + (x - top * s).clamp(min=0)) * (1 + 2.0**-20)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activations per token (a compressed-tensors FP8-dynamic checkpoint's `strategy: token`):
    (float8_e4m3fn values shaped like x, float32 scales [.., 1]), one scale per row = the row's
    finite amax / 448 (1 for an all-zero row, NaN for a row holding NaN or +-Inf, as every block
    format here marks such blocks), values saturating at +-448. The same rules as fp8_block's
    1 x 128 blocks with the block one whole row, so bit-exact on CPU and CUDA alike."""
    shape = tuple(x.shape)
    t = x.detach().float().reshape(-1, 1, shape[-1])  # [rows, 1 block, K]
    amax, bad = _block_amax(t)
    scale = torch.where(amax > 0, _div(amax, el.E4M3_MAX), 1.0)
    scale = torch.where(bad, torch.nan, scale)  # [rows, 1]
    values = el.to_e4m3(t.squeeze(1) / scale)
    return values.reshape(shape), scale.reshape(*shape[:-1], 1)


def dequantize_fp8_per_token(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 activations of `quantize_fp8_per_token`'s (values, scales)."""
    return values.float() * scales
