"""The delayed-scaling linears' native FP8 path (kernels/fp8_delayed.py) against the emulated one
on CPU: the one-pass Triton quantizer under Triton's interpreter, the weight gradient through torch's real `_scaled_mm` with scalar scales (the CPU build
has it), the block-scaled forward and data-gradient GEMMs through their emulated backend (the
CPU build has no block scaling): the same quantized operands, the same recorded amaxes, outputs
equal up to the sums' order and the emulated operands' rounding to the model dtype."""

from __future__ import annotations

import pytest
import torch

from milepost.kernels.fp8_delayed import (
    DelayedFp8NativeFn,
    quantize_per_tensor,
    runs_native,
    tensorwise_mm,
)
from milepost.kernels.fp8_quant import quantize_tensor_e4m3
from milepost.lowprec import elements as el
from milepost.lowprec.contract import Contract
from milepost.lowprec.delayed import DelayedScaling, DelayedSettings, attach_delayed, qdq_per_tensor
from milepost.lowprec.linear import apply_train_precision
from milepost.lowprec.quantize import quantize
from milepost.testing.lowprec_mlp import DecoderNamedMlp

torch.set_num_threads(2)
CPU_GEMMS = ("emulated", "scaled_mm")  # block GEMMs emulated; the per-tensor one is _scaled_mm
UP = "model.layers.0.mlp.up_proj.weight"


def _model(dtype: torch.dtype, steps: int) -> tuple[DecoderNamedMlp, DelayedScaling]:
    torch.manual_seed(0)
    m = DecoderNamedMlp(width=256).to(dtype)  # up_proj: 512 x 256, whole 128 x 128 tiles
    apply_train_precision(m, Contract("fp8_block", "fp8_block"))
    state = attach_delayed(m, DelayedSettings(history_len=4), torch.device("cpu"))
    for _ in range(steps):  # fill the history: per-tensor scales from then on
        m(torch.randn(40, 256, dtype=dtype) * 3).float().square().mean().backward()
        state.step()
    return m, state


def _run(m: DecoderNamedMlp, state: DelayedScaling, x: torch.Tensor, gy: torch.Tensor,
         native: bool) -> tuple[torch.Tensor, ...]:
    """(y, input gradient, weight gradient, the step's recorded amaxes) of up_proj."""
    up = m.model.layers[0].mlp.up_proj
    up.weight.grad = None
    state.pending.zero_()
    x = x.clone().requires_grad_(True)
    if native:
        q = quantize(up.weight.detach(), "fp8_block", "weight")
        slots = (state.slot(UP, "x"), state.slot(UP, "gy"))
        y = DelayedFp8NativeFn.apply(x, up.weight, q.values, q.scales, state, slots, True, CPU_GEMMS)
    else:
        y = up(x)  # on CPU the module's own (emulated) path
    y.backward(gy)
    return y.detach(), x.grad, up.weight.grad.clone(), state.pending.clone()


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Equal up to `rel` of the larger tensor's largest magnitude (NaN where the other is NaN)."""
    a, b = a.float(), b.float()
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.nan_to_num(), b.nan_to_num()
    return bool(((a - b).abs() <= rel * b.abs().amax()).all())


# fp32: only the sums' order differs; bf16: the emulated operands are rounded to bf16 too
@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("steps", [1, 0])  # per-tensor input scale; no history yet (1 x 128 blocks)
def test_native_path_equals_the_emulated_one(dtype: torch.dtype, rel: float, steps: int) -> None:
    m, state = _model(dtype, steps)
    assert state.seen(state.slot(UP, "x")) == bool(steps)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 37, 256, generator=g) * torch.logspace(-2, 1, 256)).to(dtype)  # 74 tokens: padded to 80
    gy = (torch.randn(2, 37, 512, generator=g) * 1e-4).to(dtype)
    emulated, native = _run(m, state, x, gy, False), _run(m, state, x, gy, True)
    for name, e, n in zip(("y", "input grad", "weight grad"), emulated, native):
        assert n.dtype == e.dtype and n.shape == e.shape, name
        assert _close(n, e, rel), f"{name}: max diff {(n.float() - e.float()).abs().max():.3g}"
    assert torch.equal(native[3], emulated[3])  # the same amaxes recorded (x and gy slots)


def test_non_finite_input_gives_nan_on_both_paths() -> None:
    m, state = _model(torch.float32, 1)
    x = torch.randn(16, 256)
    x[3, 7] = torch.inf
    gy = torch.randn(16, 512)
    emulated, native = _run(m, state, x, gy, False), _run(m, state, x, gy, True)
    assert emulated[0].isnan().all() and native[0].isnan().all()  # never a wrong finite value
    assert native[2].isnan().all() and emulated[2].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_quantizer_gives_the_torch_bits_amax_and_bad_flag(dtype: torch.dtype) -> None:
    """The Triton pass (interpreted on CPU) the native path quantizes with once a slot has history."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(37, 300, generator=g) * torch.logspace(-7, 3, 300)).to(dtype)  # subnormals..saturation
    x[0, :3] = torch.tensor([-0.0, 2e4, -2e4])
    scale = torch.tensor(0.3 * x.float().abs().amax().item() / 448.0)
    q, amax, bad = quantize_tensor_e4m3(x, scale, block=1024)  # 11 100 elements: a partial block
    assert torch.equal(q.view(torch.uint8), el.to_e4m3(x.float() / scale).view(torch.uint8))
    assert amax == x.float().abs().amax() and not bad
    x[5, 9] = torch.nan
    assert quantize_tensor_e4m3(x, scale, block=1024)[2]


def test_per_tensor_gemm_on_cpu_scaled_mm_equals_the_dequantized_product() -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(128, 50, generator=g) * 1e3, torch.randn(256, 50, generator=g) * 1e-3
    ok = torch.tensor(False)
    (aq, sa), (bq, sb) = (quantize_per_tensor(t, t.abs().amax() / 448.0, ok) for t in (a, b))
    assert torch.equal((aq.float() * sa), qdq_per_tensor(a, a.abs().amax() / 448.0))  # its bits
    ref = (aq.double() * sa.double()) @ (bq.double() * sb.double()).t()
    got = tensorwise_mm(aq, sa, bq, sb, torch.float32)  # 50 tokens zero-padded to 64
    assert ((got.double() - ref).abs() <= 1e-6 * ref.abs().amax()).all()


def test_cpu_runs_the_emulated_path() -> None:
    w = torch.zeros(256, 128)
    assert runs_native(w, torch.zeros(4, 128, dtype=torch.bfloat16)) is None
