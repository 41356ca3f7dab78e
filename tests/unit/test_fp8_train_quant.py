"""The trainer's one-pass FP8 quantizers (milepost/kernels/fp8_train_quant.py) give the unfused path's bits:
the weight tiles = the shared torch quantizer (and the transposed copy = its transpose), the strided
1 x 128 quantizer = `quantize_act_1x128` on the padded, transposed copy the unfused backward makes
and on row-major inputs with padded rows. NaN/Inf blocks: NaN scale (their bytes are not compared:
Triton's interpreter writes another NaN code than the GPU). Runs under Triton's interpreter on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from milepost.kernels.fp8_quant import quantize_act_1x128  # noqa: E402
from milepost.kernels.fp8_train_quant import quantize_blocks, quantize_weight_tiles  # noqa: E402
from milepost.lowprec.fp8_options import Fp8TrainOptions  # noqa: E402
from milepost.lowprec.quantize import quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.set_num_threads(1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


def _same(q: torch.Tensor, s: torch.Tensor, ref_q: torch.Tensor, ref_s: torch.Tensor) -> None:
    finite = ~torch.isnan(ref_q.cpu().float())
    assert torch.equal(_bytes(q)[finite], _bytes(ref_q)[finite])
    assert torch.isnan(q.cpu().float()[~finite]).all() or not (~finite).any() or DEV == "cpu"
    assert torch.equal(s.cpu().nan_to_num(-1.0), ref_s.cpu().nan_to_num(-1.0))


def _weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 384, generator=g) * torch.logspace(-3, 3, 384)[None, :]).bfloat16()
    w[0, 5] = float("nan")
    w[130, 300] = float("inf")
    w[128:256, 0:128] = 0.0  # a tile of zeros: scale 1
    w[5, 200] = -1e-38  # tiny: subnormal after scaling
    return w.to(DEV)


def test_weight_tiles_are_the_shared_quantizer_bits_and_transpose() -> None:
    w = _weight()
    ref = quantize(w, "fp8_block", "weight")
    q, s, qt = quantize_weight_tiles(w, transposed=True)
    assert q.shape == (256, 384) and s.shape == (2, 3) and qt is not None and qt.shape == (384, 256)
    _same(q, s, ref.values, ref.scales)
    assert torch.isnan(s[0, 0]) and torch.isnan(s[1, 2]) and s[1, 0] == 1.0
    assert torch.equal(_bytes(qt), _bytes(q).t())
    assert quantize_weight_tiles(w)[2] is None
    with pytest.raises(ValueError, match="whole 128 x 128 tiles"):
        quantize_weight_tiles(w[:200])


@pytest.mark.parametrize("tokens,multiple", [(200, 128), (200, 512), (256, 128)])
def test_transposed_operand_equals_the_padded_copy_then_quantize(tokens: int, multiple: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(tokens, 256, generator=g) * torch.logspace(-3, 3, tokens)[:, None]).bfloat16()
    x[3, 7] = float("nan")
    x = x.to(DEV)
    q, s = quantize_blocks(x.t(), 1, multiple)
    ref_q, ref_s = quantize_act_1x128(F.pad(x.t(), (0, (-tokens) % multiple)).contiguous())
    assert q.shape == ref_q.shape == (256, tokens + (-tokens) % multiple)
    assert s.stride() == ref_s.stride()  # M-major, as cuBLAS reads them
    _same(q, s, ref_q, ref_s)


@pytest.mark.parametrize("pad_rows", [1, 4])
def test_tiled_rows_equal_the_one_block_kernel(pad_rows: int) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(70, 384, generator=g) * torch.logspace(-3, 3, 70)[:, None]).bfloat16()
    x[9, 300] = -float("inf")
    x = x.to(DEV)
    q, s = quantize_blocks(x, pad_rows)
    ref_q, ref_s = quantize_act_1x128(x, pad_rows)
    assert q.shape == ref_q.shape and s.stride() == ref_s.stride()
    _same(q, s, ref_q, ref_s)
    with pytest.raises(ValueError, match="pad_cols"):
        quantize_blocks(x, 1, 100)


def test_options_default_to_the_measured_path() -> None:
    assert Fp8TrainOptions() == Fp8TrainOptions.all_fused() == Fp8TrainOptions("triton", "tiled", "fused")
    assert Fp8TrainOptions.unfused() == Fp8TrainOptions("torch", "rows", "copy")
    from milepost.lowprec.linear import fp8_options_arg

    lin = torch.nn.Linear(4, 4)  # the autograd functions get None (tensors only) for the defaults
    assert fp8_options_arg(lin) is None
    lin.fp8_options = Fp8TrainOptions.unfused()
    assert fp8_options_arg(lin) == Fp8TrainOptions.unfused()


def test_native_linear_with_fused_options_equals_the_unfused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fp8BlockLinearFn with every option on gives the unfused path's output and gradients bit for bit: the
    GEMMs forced to the Triton block GEMM (the interpreter on CPU), so only the quantize passes and
    the saved transposed weight differ between the two runs."""
    from milepost.kernels import fp8_gemm as fg
    from milepost.kernels import fp8_gemm_train as fgt
    from milepost.lowprec.linear import native_weight

    monkeypatch.setattr(fg, "block_backend", lambda device, m=None: "triton")
    monkeypatch.setattr(fgt, "wgrad_backend", lambda device: "triton")
    g, tokens = torch.Generator().manual_seed(3), 200  # tokens padded to whole blocks in the wgrad
    x0 = (torch.randn(tokens, 256, generator=g) * torch.logspace(-2, 2, tokens)[:, None]).bfloat16().to(DEV)
    gy = (torch.randn(tokens, 384, generator=g) * 1e-3).bfloat16().to(DEV)
    lin = torch.nn.Linear(256, 384, bias=False).bfloat16().to(DEV)
    outs = []
    for opts in (Fp8TrainOptions.unfused(), Fp8TrainOptions.all_fused()):
        lin.fp8_options = opts
        wv, ws, wvt = native_weight(lin)
        assert (wvt is None) == (opts.weight_quant == "torch")
        x, lin.weight.grad = x0.clone().requires_grad_(True), None
        args = (opts, wvt)
        y = fgt.Fp8BlockLinearFn.apply(x, lin.weight, wv, ws, *args)
        y.backward(gy)
        outs.append((y.detach(), x.grad, lin.weight.grad))
    for a, b in zip(*outs):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a.float()).all()
        assert torch.equal(a, b)
    wq = quantize(lin.weight, "fp8_block", "weight")  # and the values are the format's
    ref = (x0.float() @ (wq.values.float() * wq.scales.repeat_interleave(128, 0).repeat_interleave(128, 1)).t())
    assert ((outs[0][0].float() - ref).abs() <= 0.1 * ref.abs().amax(1, keepdim=True)).all()


def test_tensor_t_equals_the_per_tensor_quantizer_and_its_padded_transpose() -> None:
    from milepost.kernels.fp8_quant import quantize_tensor_e4m3
    from milepost.kernels.fp8_train_quant import quantize_tensor_t

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(74, 256, generator=g) * torch.logspace(-3, 2, 256)[None, :]).bfloat16().to(DEV)
    scale = torch.tensor(0.37, device=DEV)
    for bad in (False, True):
        if bad:
            x[5, 9] = float("inf")
        q, qt, amax, nonfinite = quantize_tensor_t(x, scale, 16)
        ref_q, ref_amax, ref_bad = quantize_tensor_e4m3(x, scale)
        finite = torch.isfinite(x.float()).cpu()
        assert torch.equal(_bytes(q)[finite], _bytes(ref_q)[finite])
        assert torch.equal(amax, ref_amax) and bool(nonfinite) == bool(ref_bad) == bad
        assert qt.shape == (256, 80) and torch.equal(_bytes(qt)[:, :74], _bytes(q).t())
        assert (_bytes(qt)[:, 74:] == 0).all()  # the padding tokens: +0 bytes, as F.pad gives


def test_delayed_native_fn_with_fused_options_equals_the_unfused(monkeypatch: pytest.MonkeyPatch) -> None:
    """DelayedFp8NativeFn with the fused options (per-tensor operands quantized with their
    transposes, the transposed weight from the one-pass quantizer) gives the unfused path's output and
    gradients bit for bit; on CPU the block GEMMs are emulated and the per-tensor one is torch's
    _scaled_mm, as in test_lowprec_delayed_native.py."""
    from milepost.kernels.fp8_delayed import DelayedFp8NativeFn
    from milepost.lowprec.delayed import DelayedScaling, DelayedSettings
    from milepost.lowprec.linear import native_weight

    g = torch.Generator().manual_seed(5)
    x0 = (torch.randn(74, 256, generator=g) * torch.logspace(-2, 1, 256)).bfloat16()
    gy = (torch.randn(74, 384, generator=g) * 1e-4).bfloat16()
    lin = torch.nn.Linear(256, 384, bias=False).bfloat16()
    state = DelayedScaling(["w"], DelayedSettings(history_len=4), torch.device("cpu"))
    slots = (state.slot("w", "x"), state.slot("w", "gy"))
    outs = []
    for steps, opts in ((0, Fp8TrainOptions.unfused()), (1, Fp8TrainOptions.unfused()), (1, Fp8TrainOptions.all_fused())):
        if steps and not state.seen(slots[0]):
            state.pending.fill_(3.0)
            state.step()  # a history: per-tensor scales from now on
        lin.fp8_options, lin.weight.grad = opts, None
        wv, ws, wvt = native_weight(lin)
        x = x0.clone().requires_grad_(True)
        extra = (opts, wvt)
        y = DelayedFp8NativeFn.apply(x, lin.weight, wv, ws, state, slots, True, ("emulated", "scaled_mm"), *extra)
        y.backward(gy)
        outs.append((y.detach(), x.grad, lin.weight.grad, state.pending.clone()))
        state.pending.zero_()
    for a, b in zip(outs[1], outs[2]):
        assert torch.equal(a, b)
    assert not torch.equal(outs[0][0], outs[1][0])  # the history changed the input's scale
