"""Delayed FP8 scaling's native GEMMs on CUDA (kernels/fp8_delayed.py) at the Qwen3-4B MLP shapes:
forward, input gradient and weight gradient against the emulated path (DelayedFp8LinearFn, the
CPU's values) and against the fp32 product of the same quantized operands; the trainer's forward
is the static engines' GEMM bit for bit; the times of native, emulated and plain bf16 printed.
Run on the accelerator machine (-s shows the times):
`python -m pytest -q -s -m gpu tests/gpu/test_lowprec_delayed_native_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from milepost.kernels.fp8_delayed import native_gemms
from milepost.kernels.fp8_gemm import fp8_static_linear
from milepost.lowprec.contract import Contract
from milepost.lowprec.delayed import (
    DelayedFp8LinearFn,
    DelayedScaling,
    DelayedSettings,
    attach_delayed,
    qdq_per_tensor,
)
from milepost.lowprec.quantize import dequantize, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")
TOKENS = 4096  # 4 x 1024-token sequences per micro-batch
REL = 2e-2  # max |native - emulated| / max |emulated|; measured on CPU at small shapes: 5.5e-3


class _Layer(nn.Module):
    """One linear named as a decoder layer's, so the recipe covers it."""

    def __init__(self, name: str, k: int, n: int) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([nn.Module()])
        self.model.layers[0].mlp = nn.Module()
        setattr(self.model.layers[0].mlp, name, nn.Linear(k, n, bias=False))
        self.name = f"model.layers.0.mlp.{name}.weight"

    @property
    def linear(self) -> nn.Module:
        return self.model.layers[0].mlp.get_submodule(self.name.split(".")[-2])


def _setup(name: str, k: int, n: int, steps: int) -> tuple[_Layer, DelayedScaling]:
    from milepost.lowprec.linear import apply_train_precision

    torch.manual_seed(0)
    layer = _Layer(name, k, n).to(DEV, torch.bfloat16)
    nn.init.normal_(layer.linear.weight, 0.0, 0.02)
    apply_train_precision(layer, Contract("fp8_block", "fp8_block"))
    state = attach_delayed(layer, DelayedSettings(history_len=16), DEV)
    for _ in range(steps):
        layer.linear(torch.randn(TOKENS, k, device=DEV, dtype=torch.bfloat16)).float().square().mean().backward()
        state.step()
    return layer, state


def _fwd_bwd(layer: _Layer, state: DelayedScaling, x: torch.Tensor, gy: torch.Tensor,
             native: bool) -> tuple[torch.Tensor, ...]:
    lin = layer.linear
    lin.weight.grad = None
    x = x.detach().requires_grad_(True)
    if native:
        y = lin(x)  # the module's own choice: native on a device with the GEMMs
    else:
        slots = (state.slot(layer.name, "x"), state.slot(layer.name, "gy"))
        y = DelayedFp8LinearFn.apply(x, lin.weight, lin.quantized_weight(), state, slots, True)
    y.backward(gy)
    return y.detach(), x.grad, lin.weight.grad


def _ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().amax()).item()


def test_the_device_runs_the_native_gemms() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    assert native_gemms(DEV) == (None, "scaled_mm")  # the block GEMM per M, the per-tensor _scaled_mm


@pytest.mark.parametrize(("name", "k", "n"), [("up_proj", 2560, 9728), ("down_proj", 9728, 2560)])
@pytest.mark.parametrize("steps", [2, 0])  # per-tensor input scale; no history yet (1 x 128 blocks)
def test_native_equals_emulated_at_qwen3_4b_shapes(name: str, k: int, n: int, steps: int) -> None:
    layer, state = _setup(name, k, n, steps)
    g = torch.Generator(device=DEV).manual_seed(1)
    x = (torch.randn(TOKENS, k, device=DEV, generator=g) * torch.logspace(-1, 1, k, device=DEV)).bfloat16()
    gy = (torch.randn(TOKENS, n, device=DEV, generator=g) * 1e-5).bfloat16()
    state.pending.zero_()
    emulated = _fwd_bwd(layer, state, x, gy, False)
    amax_emulated = state.pending.clone()
    state.pending.zero_()
    native = _fwd_bwd(layer, state, x, gy, True)
    assert torch.equal(state.pending, amax_emulated)  # the same amaxes recorded
    errs = {part: _rel(a, b) for part, a, b in zip(("y", "grad x", "grad w"), native, emulated)}
    # the fp32 product of the exact quantized operands (per-tensor case): both paths near it
    slot_x, slot_g = state.slot(layer.name, "x"), state.slot(layer.name, "gy")
    wq = dequantize(quantize(layer.linear.weight.detach(), "fp8_block", "weight")).float()
    if steps:
        xq = qdq_per_tensor(x.float(), state.scale[slot_x])
        y32 = F.linear(xq, wq)
        errs["y vs fp32 (native, emulated)"] = (_rel(native[0], y32), _rel(emulated[0], y32))
        gq = qdq_per_tensor(gy.float(), state.scale[slot_g])
        gw32 = gq.t() @ xq
        errs["grad w vs fp32 (native, emulated)"] = (_rel(native[2], gw32), _rel(emulated[2], gw32))
        assert max(errs["y vs fp32 (native, emulated)"][0], errs["grad w vs fp32 (native, emulated)"][0]) < 1e-2
        # the trainer's forward is the static engines' (fp8_static_linear) bit for bit
        q = quantize(layer.linear.weight.detach(), "fp8_block", "weight")
        with torch.no_grad():
            assert torch.equal(layer.linear(x), fp8_static_linear(x, q.values, q.scales, state.scale[slot_x]))
    times = {"native": _ms(lambda: _fwd_bwd(layer, state, x, gy, True)),
             "emulated": _ms(lambda: _fwd_bwd(layer, state, x, gy, False))}
    w = layer.linear.weight.detach().clone().requires_grad_(True)
    xb = x.detach().clone().requires_grad_(True)
    times["bf16"] = _ms(lambda: F.linear(xb, w).backward(gy))
    print(f"\n{name} [{TOKENS} x {k}] x [{n} x {k}]^T, {'per-tensor' if steps else 'first step'}: "
          + ", ".join(f"{p} ({v[0]:.2e}, {v[1]:.2e})" if isinstance(v, tuple) else f"{p} {v:.2e}"
                      for p, v in errs.items())
          + "; fwd+bwd ms: " + ", ".join(f"{p} {t:.3f}" for p, t in times.items())
          + f"; native {times['emulated'] / times['native']:.2f}x emulated, "
          f"{times['bf16'] / times['native']:.2f}x bf16")
    assert max(errs["y"], errs["grad x"], errs["grad w"]) < REL, errs
