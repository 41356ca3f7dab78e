"""Compressed-tensors FP8-dynamic checkpoints (per-channel FP8 weights, dynamic per-token FP8
activations) served W8A8 as they mean: the per-token quantizer (lowprec/quantize.py
`quantize_fp8_per_token`) against a reference written from the definition, the engine's greedy
tokens and log-probs against linears computed from the definition, and `--fp8-weight-only`
(W8A16, the behaviour before)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.weight_fp8 import Fp8Linear
from milepost.kernels.fp8_rowwise import emulated_rowwise_linear, rowwise_linear
from milepost.lowprec import elements as el
from milepost.lowprec.quantize import quantize_fp8_per_token
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.quant_checkpoints import write_fp8

torch.set_num_threads(1)

# Every finite non-negative E4M3 value with its code (codes 0..126; 127 is NaN), from the bits.
_CODES = torch.arange(127, dtype=torch.uint8)
_GRID = _CODES.view(torch.float8_e4m3fn).float()


def _ref_e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 codes of float32 `y` from the definition: the nearest representable magnitude
    (ties to the even code, i.e. an even mantissa), saturating at 448, sign bit from `y`
    (NaN -> 0x7F)."""
    a = y.abs().clamp(max=448.0)
    d = (a[..., None] - _GRID).abs()
    best = d.min(-1, keepdim=True).values
    tied = d == best
    even = tied & (_CODES % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, tied).float().argmax(-1).to(torch.uint8)
    codes = pick | torch.where(torch.signbit(y), 0x80, 0).to(torch.uint8)
    return torch.where(torch.isnan(y), torch.tensor(0x7F, dtype=torch.uint8), codes)


def _ref_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float32 scales [rows, 1]): scale = finite row amax / 448 (1 for a zero row, NaN
    where the row holds NaN or +-Inf), values = x / scale rounded to E4M3."""
    rows = x.float().reshape(-1, x.shape[-1])
    codes, scales = [], []
    for r in rows:
        if not torch.isfinite(r).all():
            s = torch.tensor(float("nan"))
        else:
            amax = r.abs().max()
            s = amax / torch.tensor(448.0) if amax > 0 else torch.tensor(1.0)
        scales.append(s)
        codes.append(_ref_e4m3_codes(r / s))
    return torch.stack(codes), torch.stack(scales).reshape(-1, 1)


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 200, generator=g) * torch.logspace(-6, 6, 6)[:, None]
    x[1] = 0.0  # an all-zero row
    x[2, 7] = float("nan")
    x[3, 11] = float("inf")
    x[4, :5] = torch.tensor([448.0, -448.0, 1e-12, -1e-12, 0.5])  # amax row and subnormals
    ties = torch.tensor([1.0625, 1.1875, 0.0009765625 * 3, 300.0, 448.0])  # halfway values
    # The CUDA test's input (tests/gpu/test_fp8_rowwise_cuda.py): row scales 1e-8 .. 1e8, a zero
    # row, a NaN, which as bfloat16 on the CPU carries the sign bit (CUDA's division returns +NaN).
    wide = torch.randn(64, 1000, generator=g) * torch.logspace(-8, 8, 64)[:, None]
    wide[3] = 0.0
    wide[5, 9] = float("nan")
    wide[7, 3] = -float("nan")
    # A scale of 2^-30 (amax 448 * 2^-30) and every E4M3 subnormal k * 2^-9 and the halfway
    # points between them (odd k of 2^-10): exact quotients, so ties to even are exercised.
    sub = torch.cat([torch.tensor([448.0]), torch.arange(-40, 41) * 2.0**-10]) * 2.0**-30
    return [x, x.bfloat16(), torch.cat([ties, torch.zeros(195)]).reshape(1, 200), wide,
            wide.bfloat16(), sub.reshape(1, -1)]


@pytest.mark.parametrize("i", range(6))
def test_per_token_quantizer_is_the_definition(i: int) -> None:
    x = _cases()[i]
    values, scales = quantize_fp8_per_token(x)
    codes, ref_scales = _ref_per_token(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.shape == (x.shape[0], 1)
    assert torch.equal(scales.isnan(), ref_scales.isnan())
    assert torch.equal(scales.nan_to_num(-1.0), ref_scales.nan_to_num(-1.0))
    # Every byte, NaN rows included: one NaN code (0x7F) whatever the NaN's sign, so the bytes
    # are the same on every device.
    assert torch.equal(values.view(torch.uint8).reshape(codes.shape), codes)


def test_a_nan_of_either_sign_is_code_0x7f() -> None:
    nan = torch.tensor([float("nan")] * 3)
    nan[1:] = -nan[1:]  # sign bit set
    assert torch.signbit(nan).tolist() == [False, True, True]
    x = torch.cat([nan, torch.tensor([1.0])])
    assert el.to_e4m3(x).view(torch.uint8).tolist() == [0x7F, 0x7F, 0x7F, 0x38]
    assert el.to_e4m3(x.bfloat16().float()).view(torch.uint8)[:3].tolist() == [0x7F] * 3


def test_per_token_quantizer_keeps_leading_dims_and_rows_apart() -> None:
    x = torch.randn(2, 3, 64)
    v, s = quantize_fp8_per_token(x)
    assert v.shape == x.shape and s.shape == (2, 3, 1)
    v1, s1 = quantize_fp8_per_token(x[1, 2:3])  # a token's values do not depend on its batch
    assert torch.equal(v[1, 2:3].view(torch.uint8), v1.view(torch.uint8)) and torch.equal(s[1, 2:3], s1)


def _ref_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The checkpoint's meaning from the reference quantizer: Q_token(x) dequantized in x's
    dtype times the weight's values * row scales, GEMM in x's dtype."""
    codes, s = _ref_per_token(x)
    xd = (codes.view(torch.float8_e4m3fn).float() * s).reshape(x.shape).to(x.dtype)
    wd = (w.float() * sw.float().reshape(-1, 1)).to(x.dtype)
    return F.linear(xd, wd, bias)


def test_rowwise_linear_on_cpu_is_the_emulated_definition() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 48, generator=g)
    w = (torch.randn(32, 48, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sw, bias = torch.rand(32, generator=g) * 1e-2, torch.randn(32, generator=g)
    y = rowwise_linear(x, w, sw, bias)
    assert torch.equal(y, emulated_rowwise_linear(x, w, sw, bias))
    assert torch.equal(y, _ref_linear(x, w, sw, bias))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = make_tiny_checkpoint(tmp_path_factory.mktemp("dyn") / "bf16", "qwen3", seed=3,
                               with_tokenizer=False, hidden_size=160, intermediate_size=272)
    dst = src.parent / "pc"
    write_fp8(src, dst, "channel")  # input_activations: dynamic, strategy token (FP8-dynamic)
    return dst


def _args(path: Path, **kw: object) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=8, max_total_tokens=256, **kw).resolved()


def _greedy(engine: object) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_outputs(engine, random_prompts((9, 5), seed=7), max_new_tokens=5)


def _linears(engine: object) -> list[Fp8Linear]:
    return [m for m in engine.runner.model.modules() if isinstance(m, Fp8Linear)]  # type: ignore[attr-defined]


def test_fp8_dynamic_engine_is_w8a8_by_definition(ckpt: Path) -> None:
    """Default: every row-store linear quantizes its input per token; greedy tokens and
    log-probs equal an engine whose linears compute the definition with the reference quantizer."""
    engine = build_engine(_args(ckpt))[0]
    assert engine.runner.model.model.layers[0].mlp.gate_up_proj.act_per_token
    assert all(m.act_per_token for m in _linears(engine))
    got = _greedy(engine)
    ref = build_engine(_args(ckpt, fp8_weight_only=True))[0]
    for m in _linears(ref):
        assert not m.act_per_token
        m.forward = (lambda mod: lambda x: _ref_linear(x, mod.weight, mod.weight_scale, mod.bias))(m)  # type: ignore[method-assign]
    assert got == _greedy(ref)


def test_fp8_weight_only_keeps_w8a16(ckpt: Path) -> None:
    """--fp8-weight-only: activations stay in --dtype (the weights as stored), so the forward is
    the weights' dequantized values times unquantized inputs, unlike the W8A8 default."""
    w8a16 = build_engine(_args(ckpt, fp8_weight_only=True))[0]
    ref = build_engine(_args(ckpt))[0]
    for m in _linears(ref):  # the definition of W8A16 with the same stored weights
        m.act_per_token = False
        m.forward = (lambda mod: lambda x: F.linear(  # type: ignore[method-assign]
            x, (mod.weight.float() * mod.weight_scale.float()[:, None]).to(x.dtype), mod.bias))(m)
    plain = _greedy(w8a16)
    assert plain == _greedy(ref)
    assert plain[1] != _greedy(build_engine(_args(ckpt))[0])[1]  # W8A8 log-probs differ


def test_fp8_weight_only_elsewhere_is_refused(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=3, with_tokenizer=False)
    with pytest.raises(ValueError, match="--fp8-weight-only keeps a per-channel FP8"):
        ServerArgs(model_path=src, device="cpu", fp8_weight_only=True)
    with pytest.raises(ValueError, match="--fp8-weight-only keeps a per-channel FP8"):
        ServerArgs(model_path=src, device="cpu", fp8_weight_only=True, quantization="fp8_block")
    ServerArgs(model_path=src, device="cpu", fp8_weight_only=True, quantization="fp8")  # W8A16 anyway


@pytest.mark.parametrize("inputs", [
    {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True},
    {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
])
def test_other_dynamic_activations_are_refused(ckpt: Path, tmp_path: Path, inputs: dict) -> None:
    dst = tmp_path / "x"
    dst.mkdir()
    for f in ckpt.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = inputs
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="served with dynamic 8-bit float activations per token"):
        ServerArgs(model_path=dst, device="cpu")
