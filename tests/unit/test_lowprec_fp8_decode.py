"""The decode-M FP8 block GEMM (milepost/kernels/fp8_decode.py `decode_block_mm`) against the
emulated product: fused and separate activation quantization, split-K sums, row and weight
blocks of every width. Without CUDA it runs under Triton's interpreter (float8 tl.dot included).
Programmatic dependent launch (`pdl`) is CUDA-only: benchmarks/fp8_gemm_sweep.py checks it there.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from milepost.kernels.fp8_decode import DecodeConfig, decode_block_mm, decode_config
from milepost.kernels.fp8_gemm import emulated_block_mm
from milepost.lowprec.quantize import quantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [DecodeConfig(16, 64, 1, 4, 2, True), DecodeConfig(16, 128, 2, 4, 3, False),
           DecodeConfig(16, 32, 3, 4, 3, True), DecodeConfig(32, 128, 3, 4, 4, True, True),
           DecodeConfig(16, 64, 2, 4, 2, False, True), DecodeConfig(16, 256, 2, 4, 2, True, True)]


def _reference(x: torch.Tensor, w) -> torch.Tensor:
    xq = quantize(x.float().cpu(), "fp8_block", "activation")
    return emulated_block_mm(xq.values, xq.scales, w.values.cpu(), w.scales.cpu(), torch.float32)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_decode_gemm_equals_the_emulated_product(cfg: DecodeConfig) -> None:
    """Rows whose scales span eight orders of magnitude, 3 K blocks (an uneven split), two row
    blocks (M = 20 > 16), and a row holding Inf (its 1x128 block's NaN scale: a NaN row)."""
    g = torch.Generator().manual_seed(0)
    m, n, k = 20, 256, 384
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 4, m)[:, None]
    x[5, 200] = math.inf
    x = x.to(torch.bfloat16)
    w = quantize(torch.randn(n, k, generator=g) * torch.logspace(-1, 1, k)[None, :], "fp8_block")
    ref = _reference(x, w)
    y = decode_block_mm(x.to(DEV), w.values.to(DEV), w.scales.to(DEV), torch.float32, cfg).cpu()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(y[5]).all()
    ok = ~torch.isnan(ref)
    tol = 1e-5 * ref.abs().nan_to_num().amax(1, keepdim=True).expand_as(ref)
    assert ((y - ref).abs()[ok] <= tol[ok]).all()


@pytest.mark.parametrize("fused", [True, False])
def test_decode_gemm_quantizes_activations_to_the_reference_bits(fused: bool) -> None:
    """With 128 x 128 identity weight tiles the output is each quantized activation times its
    scale: one E4M3 code off would move it by 1/16 or more. Row 0's block has amax 448 (scale
    exactly 1) and values on rounding ties (1.0625 -> 1, 1.1875 -> 1.25), subnormal ties and
    values past the largest normal; the other rows are random at several scales."""
    g = torch.Generator().manual_seed(1)
    m, k = 5, 256
    x = torch.randn(m, k, generator=g) * torch.tensor([1.0, 1e-3, 1.0, 1e3, 1e-20])[:, None]
    ties = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 3 * 2.0**-10, 2.0**-10, -416.0, 432.0])
    x[0, : ties.numel()] = ties
    x = x.to(torch.bfloat16)
    w = quantize(torch.eye(k), "fp8_block")
    xq = quantize(x.float(), "fp8_block", "activation")
    ref = xq.values.float() * xq.scales.repeat_interleave(128, 1)
    cfg = DecodeConfig(16, 64, 2, 4, 2, fused)
    y = decode_block_mm(x.to(DEV), w.values.to(DEV), w.scales.to(DEV), torch.float32, cfg).cpu()
    assert torch.equal(y == 0, ref == 0)
    assert ((y - ref).abs() <= 1e-5 * ref.abs()).all()
    assert ref[0, 1] == 1.0 and ref[0, 2] == 1.25  # the ties went to even, as the check needs


def test_split_sums_are_the_same_by_ticket_or_second_kernel() -> None:
    """The parts are added in one order either way: bit-identical outputs, and the ticket
    counters are back at zero afterwards (the next kernel, or graph replay, starts clean)."""
    from milepost.kernels import fp8_decode

    g = torch.Generator().manual_seed(2)
    x = torch.randn(24, 640, generator=g).to(torch.bfloat16).to(DEV)
    w = quantize(torch.randn(384, 640, generator=g), "fp8_block")
    wv, ws = w.values.to(DEV), w.scales.to(DEV)
    a = decode_block_mm(x, wv, ws, torch.bfloat16, DecodeConfig(16, 32, 4, 4, 2, True, False))
    b = decode_block_mm(x, wv, ws, torch.bfloat16, DecodeConfig(16, 32, 4, 4, 2, True, True))
    assert torch.equal(a, b)
    assert not fp8_decode._tickets(torch.device(DEV)).any()


@pytest.mark.parametrize("override", [True, False])
def test_ticket_switch_overrides_every_config_with_the_same_bits(monkeypatch: pytest.MonkeyPatch,
                                                                 override: bool) -> None:
    """fp8_decode.TICKET sums every split config's parts its way (True: no second kernel is
    launched; False: one is, for a ticket config too), for the bf16 and the prequantized entry
    points, and the output bits are the config's own way's."""
    from milepost.kernels import fp8_decode
    from milepost.kernels.fp8_quant import quantize_act_1x128

    g = torch.Generator().manual_seed(4)
    x = torch.randn(24, 640, generator=g).to(torch.bfloat16).to(DEV)
    w = quantize(torch.randn(384, 640, generator=g), "fp8_block")
    wv, ws = w.values.to(DEV), w.scales.to(DEV)
    cfg = DecodeConfig(16, 32, 4, 4, 2, False, not override)  # the opposite of the switch
    want = decode_block_mm(x, wv, ws, torch.bfloat16, cfg)
    launches = []
    second = fp8_decode._sum_parts_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return second[grid]

    monkeypatch.setattr(fp8_decode, "_sum_parts_kernel", Counted())
    monkeypatch.setattr(fp8_decode, "TICKET", override)
    xq, sx = quantize_act_1x128(x, 4)
    got = [decode_block_mm(x, wv, ws, torch.bfloat16, cfg),
           fp8_decode.decode_block_mm_quantized(xq, sx, 24, wv, ws, torch.bfloat16, cfg)]
    assert len(launches) == (0 if override else 2)
    for y in got:
        assert torch.equal(y, want)
    assert not fp8_decode._tickets(torch.device(DEV)).any()


def test_quant_rows_switch_gives_the_same_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_decode.QUANT_ROWS: the activation quantized by quantize_rows_fp8 (8 blocks a
    program, rows padded to 4) instead of quantize_act_1x128: the same output bits."""
    from milepost.kernels import fp8_decode

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 1280, generator=g) * torch.logspace(-3, 3, 6)[:, None]).to(torch.bfloat16)
    x[2, 7] = math.inf
    x = x.to(DEV)
    w = quantize(torch.randn(256, 1280, generator=g), "fp8_block")
    wv, ws = w.values.to(DEV), w.scales.to(DEV)
    cfg = DecodeConfig(16, 64, 3, 4, 2, False)
    monkeypatch.setattr(fp8_decode, "QUANT_ROWS", False)
    want = decode_block_mm(x, wv, ws, torch.bfloat16, cfg)
    calls = []
    monkeypatch.setattr(fp8_decode, "quantize_act_1x128", lambda *a, **kw: calls.append(a))
    monkeypatch.setattr(fp8_decode, "QUANT_ROWS", True)
    got = decode_block_mm(x, wv, ws, torch.bfloat16, cfg)
    assert not calls  # the row quantizer ran instead
    assert torch.equal(got.isnan(), want.isnan()) and got[2].isnan().all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("m", [1, 3, 8])
def test_narrow_quantization_gives_the_same_rows(m: int) -> None:
    """Quantizing only M's power of two rows (repeated to the 16 the dot needs) gives the
    product of quantizing all 16: the same bits, and the emulated product."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(m, 384, generator=g) * torch.logspace(-3, 3, m)[:, None]).to(torch.bfloat16)
    w = quantize(torch.randn(256, 384, generator=g), "fp8_block")
    wv, ws = w.values.to(DEV), w.scales.to(DEV)
    cfg = DecodeConfig(16, 64, 2, 4, 2, True, True)
    a = decode_block_mm(x.to(DEV), wv, ws, torch.float32, cfg)
    b = decode_block_mm(x.to(DEV), wv, ws, torch.float32, cfg._replace(narrow=True))
    assert torch.equal(a, b)
    ref = _reference(x, w)
    assert ((b.cpu() - ref).abs() <= 1e-5 * ref.abs().amax(1, keepdim=True)).all()


def test_decode_config_rule_and_table_lookup() -> None:
    """Without a table entry: the smallest row block holding M, K split while SMs are idle, the
    activations quantized by their own kernel; with one: the measured config of M's bucket."""
    from milepost.kernels.fp8_decode import DECODE_TABLE

    cfg = decode_config(1, 2560, 9856, 132)
    assert cfg.block_m == 16 and cfg.split > 1 and (2560 // cfg.block_n) * cfg.split <= 2 * 132
    assert not cfg.fused and decode_config(200, 19456, 2688, 132).block_m == 64
    assert decode_config(50, 6144, 2560, 132) == DECODE_TABLE[(6144, 2560, 64)]
