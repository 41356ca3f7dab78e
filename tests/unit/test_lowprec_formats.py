"""The low-precision formats against references written from their definitions.

The references here decode every code from its bit fields (OCP FP8 E4M3, E2M1, UE8M0) and round
by searching that table for the nearest value (ties to the even code), then build each block
format per block in plain loops from its description (DeepSeek-V3 128x128 tiles, OCP MX 1.0
section 6.3, NVIDIA's NVFP4): a code path independent of milepost.lowprec's vectorized one.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from milepost.lowprec import elements as el
from milepost.lowprec.quantize import (
    FORMATS,
    dequantize,
    element_scale,
    error_bound,
    quantize,
)

torch.set_num_threads(1)


def e4m3_ref(code: int) -> float:
    s, e, m = code >> 7, (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return math.nan
    v = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if s else v


def e2m1_ref(code: int) -> float:
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -v if s else v


def nearest(x: torch.Tensor, decode, n_codes: int) -> torch.Tensor:
    """Round to the nearest finite code of the table (ties to the even code), saturating."""
    codes = [c for c in range(n_codes // 2) if not math.isnan(decode(c))]  # the positive half
    table = torch.tensor([decode(c) for c in codes], dtype=torch.float64)
    a = x.double().abs().reshape(-1, 1).clamp(max=table.max())  # saturation, by definition
    d = (a - table).abs()
    best = d.min(1, keepdim=True).values
    odd = torch.tensor([c & 1 for c in codes], dtype=torch.float64)
    pick = torch.where(d == best, odd, 2.0).argmin(1)  # among the nearest, the even code
    out = torch.copysign(table[pick].reshape(x.shape), x.double()).float()
    return torch.where(torch.isnan(x), x, out)


def probe(table: list[float], top: float) -> torch.Tensor:
    """Every value, every midpoint (the ties), points just around them, and beyond the max."""
    v = sorted({abs(t) for t in table if not math.isnan(t)})
    mids = [(a + b) / 2 for a, b in itertools.pairwise(v)]
    pts = torch.tensor(v + mids + [top * 1.01, top * 1.0625, top * 3, 1e30], dtype=torch.float32)
    pts = torch.cat([pts, torch.nextafter(pts, torch.tensor(math.inf)),
                     torch.nextafter(pts, torch.tensor(0.0))])
    return torch.cat([pts, -pts, torch.randn(4000) * top / 4])


def test_e4m3_decode_matches_torch_bits() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    ref = torch.tensor([e4m3_ref(c) for c in range(256)])
    ours = codes.view(el.E4M3).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref)) and int(torch.isnan(ref).sum()) == 2
    finite = ~torch.isnan(ref)
    assert torch.equal(ours[finite], ref[finite]) and ref[finite].max() == el.E4M3_MAX
    assert ref[1] == 2.0**-9  # the smallest subnormal


def test_e4m3_rounding_matches_reference() -> None:
    x = probe([e4m3_ref(c) for c in range(256)], el.E4M3_MAX)
    ref = nearest(x, e4m3_ref, 256)
    assert torch.equal(el.round_e4m3(x), ref)
    assert torch.equal(el.to_e4m3(x).float(), ref)
    nan = torch.tensor([math.nan, math.inf, -math.inf])
    assert torch.isnan(el.to_e4m3(nan[:1]).float()).all()
    assert el.to_e4m3(nan[1:]).float().tolist() == [448.0, -448.0]  # saturating, no Inf code


def test_e2m1_rounding_codes_and_packing() -> None:
    table = [e2m1_ref(c) for c in range(16)]
    assert sorted({abs(t) for t in table}) == list(el.E2M1_VALUES)
    assert torch.equal(el.e2m1_decode(torch.arange(16)), torch.tensor(table))
    x = probe(table, el.E2M1_MAX)
    ref = nearest(x, e2m1_ref, 16)
    got = el.round_e2m1(x)
    assert torch.equal(got, ref)
    assert el.round_e2m1(torch.tensor([0.25, 0.75, 2.5, 5.0])).tolist() == [0.0, 1.0, 2.0, 4.0]
    codes = el.e2m1_codes(got)
    assert torch.equal(el.e2m1_decode(codes), got)
    packed = el.pack_nibbles(codes[: codes.numel() // 2 * 2])
    assert packed.dtype == torch.uint8 and torch.equal(el.unpack_nibbles(packed),
                                                       codes[: codes.numel() // 2 * 2])
    assert el.pack_nibbles(torch.tensor([1, 15], dtype=torch.uint8)).item() == 0xF1


def test_e8m0_decode() -> None:
    dec = el.e8m0_decode(torch.arange(256, dtype=torch.uint8))
    assert all(dec[c].item() == 2.0 ** (c - 127) for c in range(255)) and math.isnan(dec[255])


def ref_blocks(x: torch.Tensor, fmt: str, four_over_six: bool = False) -> torch.Tensor:
    """Dequantized reference, block by block (x: [R, C], weights)."""
    r, c = x.shape
    out = torch.empty_like(x)
    if fmt == "fp8_block":
        for i in range(0, r, 128):
            for j in range(0, c, 128):
                blk = x[i:i + 128, j:j + 128]
                s = torch.tensor(blk.abs().max().item() / 448.0, dtype=torch.float32)
                s = s if s > 0 else torch.tensor(1.0)
                out[i:i + 128, j:j + 128] = nearest(blk / s, e4m3_ref, 256) * s
        return out
    if fmt == "int4":  # symmetric groups of 128 along a row, scale amax / 7, values -8..7
        for i in range(r):
            for j in range(0, c, 128):
                blk = x[i, j:j + 128]
                s = torch.tensor(blk.abs().max().item() / 7.0, dtype=torch.float32)
                s = s if s > 0 else torch.tensor(1.0)
                q = torch.tensor([min(7, max(-8, round(v))) for v in (blk / s).tolist()])
                out[i, j:j + 128] = q * s  # Python's round(): half to even
        return out
    if fmt == "mxfp8":
        for i in range(r):
            for j in range(0, c, 32):
                blk = x[i, j:j + 32]
                amax = blk.abs().max().item()
                e = max(-127, math.frexp(amax)[1] - 1 - 8) if amax > 0 else -127
                out[i, j:j + 32] = nearest(blk / 2.0**e, e4m3_ref, 256) * 2.0**e
        return out
    smax = 256.0 if four_over_six else 448.0
    g = torch.tensor(x.abs().max().item() / (6 * smax), dtype=torch.float32)
    for i in range(r):
        for j in range(0, c, 16):
            blk = x[i, j:j + 16]
            best = None
            for top in ((6.0, 4.0) if four_over_six else (6.0,)):
                s = nearest(torch.tensor([blk.abs().max().item() / top]) / g, e4m3_ref, 256)
                d = s * g
                deq = nearest(blk / d, e2m1_ref, 16) * d if d > 0 else torch.zeros_like(blk)
                err = ((deq - blk) ** 2).sum().item()
                if best is None or err < best[0]:
                    best = (err, deq)
            out[i, j:j + 16] = best[1]
    return out


@pytest.mark.parametrize("fmt,four", [("fp8_block", False), ("mxfp8", False), ("nvfp4", False),
                                      ("nvfp4", True), ("int4", False)])
def test_block_formats_match_reference(fmt: str, four: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    r, c = {"fp8_block": (136, 272), "int4": (6, 200)}.get(fmt, (12, 96))  # partial tiles too
    x = torch.randn(r, c, generator=gen) * torch.logspace(-6, 2, r).reshape(-1, 1)
    x[0, :16] = 0.0  # an all-zero block
    x[1, 3] = 1e-12  # a value under the smallest subnormal
    q = quantize(x, fmt, "weight", four_over_six=four)
    assert torch.equal(dequantize(q), ref_blocks(x, fmt, four))
    assert (dequantize(q)[0, :16] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_finite_blocks_are_nan_and_others_untouched(fmt: str) -> None:
    x = torch.randn(4, 256)
    clean = dequantize(quantize(x, fmt, "activation"))
    x[1, 5], x[2, 250] = math.nan, math.inf
    d = dequantize(quantize(x, fmt, "activation"))
    block = {"fp8_block": 128, "mxfp8": 32, "nvfp4": 16, "int4": 128}[fmt]
    assert torch.isnan(d[1, :block]).all() and torch.isnan(d[2, 256 - block:]).all()
    assert torch.equal(d[0], clean[0]) and torch.equal(d[3], clean[3])  # per token: unaffected


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_bound_holds_and_is_tight(fmt: str) -> None:
    x = torch.randn(256, 512) * torch.rand(256, 1) * 30
    q = quantize(x, fmt, "weight")
    err = (dequantize(q) - x).abs() / error_bound(fmt, x, element_scale(q))
    assert err.max() <= 1.0 and err.max() > 0.5  # a bound several times too loose would fail


def test_activation_scales_per_token_do_not_depend_on_the_batch() -> None:
    x = torch.randn(8, 64)
    alone = dequantize(quantize(x[:1], "nvfp4", "activation"))
    with_big = torch.cat([x[:1], x[1:] * 1000])
    assert torch.equal(dequantize(quantize(with_big, "nvfp4", "activation"))[:1], alone)


def test_shapes_that_do_not_divide_are_refused_naming_the_tensor() -> None:
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight: nvfp4 blocks of 16"):
        quantize(torch.randn(4, 40), "nvfp4", name="model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="mxfp8 blocks of 32"):
        quantize(torch.randn(4, 48), "mxfp8")
    assert dequantize(quantize(torch.randn(3, 200), "fp8_block")).shape == (3, 200)


def test_scales_are_correctly_rounded_quotients() -> None:
    """A block's scale is amax / 448 (FP8) or amax / 7 (INT4) correctly rounded, the division
    every device gives bit for bit; a multiply by the divisor's reciprocal (what CUDA does with
    a Python-number divisor) is off by one ulp for about half of all amax values."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(512, 256, generator=gen) * torch.logspace(-6, 6, 512).reshape(-1, 1)
    for fmt, role, div in (("fp8_block", "activation", 448.0), ("int4", "weight", 7.0)):
        q = quantize(x, fmt, role)
        amax = x.abs().reshape(512, 2, 128).amax(-1)
        exact = (amax.double() / div).float()  # float64 then float32: correctly rounded
        assert torch.equal(q.scales.reshape(512, 2), exact), fmt
        assert not torch.equal(exact, amax * (1.0 / torch.tensor(div)))  # the test can tell
