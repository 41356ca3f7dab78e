"""Element formats: E4M3 (OCP FP8, "fn": no infinities, one NaN code per sign), E2M1 (FP4: no
NaN or infinity) and UE8M0 (an 8-bit power of two, 0xFF = NaN, the MX shared scale).

Rounding is to nearest, ties to even, saturating at the largest finite value (what the OCP MX
spec prescribes for element conversion; our block quantizers never feed an out-of-range value).
NaN stays NaN where the format has one; E2M1 has none, so its callers handle NaN at block level.

No function here makes a tensor from host data (a table copied to the device): the engine's
forward runs them under CUDA graphs, where a host-to-device copy fails the capture. Code tables
are computed on the values' device from the bits instead (integer arithmetic: exact anywhere).
"""

from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_NAN = 255
E8M0_BIAS = 127
# The eight E2M1 magnitudes in code order (code = sign << 3 | index).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_minifloat(x: torch.Tensor, mantissa_bits: int, min_exponent: int, max_value: float
                    ) -> torch.Tensor:
    """float32 `x` rounded to a binary float with `mantissa_bits` stored mantissa bits, smallest
    normal exponent `min_exponent` (below it: subnormals of the same step) and largest finite
    `max_value` (saturating). Ties to even; NaN stays NaN."""
    x = x.float()
    a = x.abs()
    _, exp = torch.frexp(a)  # a = m * 2^exp, m in [0.5, 1): floor(log2 a) = exp - 1, exactly
    e = (exp - 1).clamp(min=min_exponent)
    step = torch.ldexp(torch.ones_like(a), e - mantissa_bits)
    q = torch.round(a / step) * step  # power-of-two step: exact; torch.round ties to even
    q = q.clamp(max=max_value)
    return torch.where(torch.isnan(x), x, torch.copysign(q, x))


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 values of `x` rounded to E4M3 (saturating at 448)."""
    return round_minifloat(x, 3, -6, E4M3_MAX)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x` as float8_e4m3fn, saturating at +-448 (torch's cast alone is not specified there).
    Every NaN becomes the one code 0x7F: a NaN's sign bit is not portable (x86 division passes
    a NaN operand through with its sign, CUDA returns a canonical +NaN; a CPU cast of NaN to
    bfloat16 sets the sign), and the shared quantizer must give the same bytes on every device."""
    x = x.float()
    return torch.where(torch.isnan(x), math.nan, x.clamp(-E4M3_MAX, E4M3_MAX)).to(E4M3)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float32 values of `x` rounded to E2M1 (saturating at 6). NaN input stays NaN here; the
    NVFP4 quantizer marks such blocks through their scale, since E2M1 has no NaN code."""
    return round_minifloat(x, 1, 0, E2M1_MAX)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8, 0..15) of E2M1-representable float32 `values` (NaN -> +0). The index
    of a magnitude is how many E2M1 values lie below it (a sorted-table search, counted with
    scalar compares so no table reaches the device)."""
    mag = torch.nan_to_num(values.abs(), nan=0.0)
    index = torch.zeros(mag.shape, dtype=torch.uint8, device=mag.device)
    for v in E2M1_VALUES:
        index += mag > v
    sign = (torch.signbit(values) & (mag > 0)).to(torch.uint8) << 3
    return index | sign


def e2m1_magnitude(index: torch.Tensor) -> torch.Tensor:
    """float32 magnitudes of E2M1 indices 0..7 (E2M1_VALUES[index]): index i >= 2 is
    (2 + (i & 1)) * 2^(i >> 1) / 4 (1, 1.5, 2, 3, 4, 6), i < 2 is i / 2 (0, 0.5); small
    integers and a power-of-two factor, so exact."""
    i = index.to(torch.int32)
    normal = ((2 + (i & 1)) << (i >> 1)).float() * 0.25
    return torch.where(i < 2, i.float() * 0.5, normal)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 `codes` (code 8 is -0.0)."""
    c = codes.to(torch.int32)
    mag = e2m1_magnitude(c & 7)
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dim: element 2i in the low nibble, 2i+1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 `values` in -8..7 [.., K] -> uint8 [.., ceil(K/2)]: two's-complement nibbles, element
    2i in the low nibble, 2i+1 high (pack_nibbles' order); an odd K gets a zero high nibble."""
    codes = (values.to(torch.int16) & 15).to(torch.uint8)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return pack_nibbles(codes)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The int8 values (-8..7) [.., k] of pack_int4's bytes: a nibble n is (n ^ 8) - 8."""
    n = unpack_nibbles(packed)[..., :k].to(torch.int16)
    return ((n ^ 8) - 8).to(torch.int8)


_F32_QNAN_BITS = 0x7FC00000  # float32 quiet NaN, the bits of math.nan as float32
_F32_2_POW_M127_BITS = 0x00400000  # 2^-127: a float32 subnormal (mantissa bit 22)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 scales of UE8M0 `codes` (uint8); 255 is NaN. Code c means 2^(c - 127): float32
    shares the bias 127, so for c in 1..254 the float's bits are c << 23 (exponent field c,
    mantissa 0); code 0 is the subnormal 2^-127. Built from the bits: exact on every device."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, _F32_2_POW_M127_BITS, c << 23)
    bits = torch.where(c == E8M0_NAN, _F32_QNAN_BITS, bits)
    return bits.view(torch.float32)
