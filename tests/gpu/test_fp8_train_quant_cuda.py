"""On a Hopper GPU: the trainer's one-pass FP8 quantizers (kernels/fp8_train_quant.py) give
today's bytes at Qwen3-4B shapes, and a native FP8 linear under `Fp8TrainOptions.all_fused()`
gives today's output, input gradient and weight gradient bit for bit (same values, same GEMMs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper GPU", allow_module_level=True)

from milepost.kernels.fp8_quant import quantize_act_1x128  # noqa: E402
from milepost.kernels.fp8_train_quant import quantize_blocks, quantize_weight_tiles  # noqa: E402
from milepost.lowprec.fp8_options import Fp8TrainOptions  # noqa: E402
from milepost.lowprec.linear import LowPrecLinear  # noqa: E402
from milepost.lowprec.quantize import quantize  # noqa: E402


def _b(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("n,k", [(9728, 2560), (2560, 9728), (1024, 2560)])
def test_kernels_give_todays_bytes_at_4b_shapes(n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    w[7, 9] = float("nan")
    ref = quantize(w, "fp8_block", "weight")
    q, s, qt = quantize_weight_tiles(w, True)
    assert torch.equal(_b(q), _b(ref.values)) and torch.equal(s.nan_to_num(-1), ref.scales.nan_to_num(-1))
    assert torch.equal(_b(qt), _b(q).t())
    x = torch.randn(4000, k, device="cuda", generator=g, dtype=torch.bfloat16)
    for multiple in (128, 512):
        a, sa = quantize_blocks(x.t(), 1, multiple)
        ra, rsa = quantize_act_1x128(F.pad(x.t(), (0, (-4000) % multiple)).contiguous())
        assert torch.equal(_b(a), _b(ra)) and torch.equal(sa, rsa)
    a, sa = quantize_blocks(x, 4)
    ra, rsa = quantize_act_1x128(x, 4)
    assert torch.equal(_b(a), _b(ra)) and torch.equal(sa, rsa)


def _linear(n: int, k: int, opts: Fp8TrainOptions) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    lin.__class__ = LowPrecLinear
    lin.qformat, lin.four_over_six, lin.dequantized_backward, lin.fp8_options = "fp8_block", False, False, opts
    return lin


@pytest.mark.parametrize("tokens", [4096, 1000])
def test_fused_options_train_bitwise_like_today(tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x0 = torch.randn(tokens, 2560, device="cuda", generator=g, dtype=torch.bfloat16)
    gy = torch.randn(tokens, 9728, device="cuda", generator=g, dtype=torch.bfloat16) * 1e-3
    outs = []
    for opts in (Fp8TrainOptions.unfused(), Fp8TrainOptions.all_fused()):
        lin, x = _linear(9728, 2560, opts), x0.clone().requires_grad_(True)
        y = lin(x)
        y.backward(gy)
        outs.append((y.detach(), x.grad, lin.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_delayed_fused_options_train_bitwise_like_today() -> None:
    from milepost.lowprec.delayed import DelayedScaling, DelayedSettings

    g = torch.Generator(device="cuda").manual_seed(2)
    x0 = torch.randn(1000, 2560, device="cuda", generator=g, dtype=torch.bfloat16)
    gy = torch.randn(1000, 9728, device="cuda", generator=g, dtype=torch.bfloat16) * 1e-3
    outs = []
    for opts in (Fp8TrainOptions.unfused(), Fp8TrainOptions.all_fused()):
        lin = _linear(9728, 2560, opts)
        state = DelayedScaling(["w"], DelayedSettings(), torch.device("cuda"))
        lin.__dict__["_delayed"] = (state, (state.slot("w", "x"), state.slot("w", "gy")), True)
        lin(x0).backward(gy)
        state.step()  # per-tensor scales from here
        lin.weight.grad = None
        x = x0.clone().requires_grad_(True)
        y = lin(x)
        y.backward(gy)
        outs.append((y.detach(), x.grad, lin.weight.grad, state.pending.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
