"""The trainer's quantized linears (emulated FP8 / MXFP8 / NVFP4 GEMMs, forward and backward)
and the precision contract's rules."""

from __future__ import annotations

import pytest
import torch

from milepost.lowprec.contract import (
    Contract,
    contract_refusals,
    native_support,
    parse_overrides,
)
from milepost.lowprec.linear import LowPrecLinear, apply_train_precision, qdq
from milepost.testing.lowprec_mlp import DecoderNamedMlp

torch.set_num_threads(1)


@pytest.mark.parametrize("fmt,tol", [("fp8_block", 0.15), ("mxfp8", 0.15), ("nvfp4", 0.6)])
def test_quantized_gradients_track_the_exact_ones(fmt: str, tol: float) -> None:
    torch.manual_seed(0)
    exact = DecoderNamedMlp()
    quant = DecoderNamedMlp()
    quant.load_state_dict(exact.state_dict())
    assert apply_train_precision(quant, Contract(fmt, fmt)) == [
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    x = torch.randn(48, 64)
    for m in (exact, quant):
        m(x).square().mean().backward()
    for a, b in zip(exact.parameters(), quant.parameters()):
        rel = (a.grad - b.grad).norm() / a.grad.norm()
        assert 0 < rel < tol  # quantized (differs), yet the same direction


def test_dequantized_backward_runs_the_backward_on_the_forward_operands() -> None:
    torch.manual_seed(1)
    m = DecoderNamedMlp()
    apply_train_precision(m, Contract("nvfp4", "nvfp4"), dequantized_backward=True)
    x = torch.randn(16, 64, requires_grad=True)
    up = m.model.layers[0].mlp.up_proj
    y = up(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    xq = qdq(x.detach(), "nvfp4")
    assert torch.allclose(up.weight.grad, gy.t() @ xq, atol=1e-5)
    assert torch.allclose(x.grad, gy @ up.quantized_weight(), atol=1e-5)


def test_int4_qat_fake_quantizes_forward_and_passes_gradients_straight_through() -> None:
    torch.manual_seed(2)
    m = DecoderNamedMlp()
    apply_train_precision(m, Contract("int4", "int4"))
    up = m.model.layers[0].mlp.up_proj
    x = torch.randn(8, 64, requires_grad=True)
    y = up(x)
    wq = qdq(up.weight.detach(), "int4", "weight")
    assert len(torch.unique(wq[0, :64] / wq[0, :64].abs().max())) <= 15  # 4-bit grid
    assert torch.allclose(y, x @ wq.t(), atol=1e-6)  # weight-only: x unquantized
    gy = torch.randn_like(y)
    y.backward(gy)
    assert torch.allclose(up.weight.grad, gy.t() @ x.detach(), atol=1e-5)  # straight through
    assert torch.allclose(x.grad, gy @ wq, atol=1e-5)


def test_fp8_training_follows_the_exact_loss_curve() -> None:
    """A fixed synthetic regression, 150 Adam steps: the FP8 run ends within 3% of fp32's loss."""
    losses = {}
    for fmt in ("bf16", "fp8_block"):
        torch.manual_seed(3)
        teacher, m = DecoderNamedMlp(), DecoderNamedMlp()
        if fmt != "bf16":
            apply_train_precision(m, Contract(fmt, fmt))
        opt = torch.optim.Adam(m.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(4)
        for _ in range(150):
            x = torch.randn(64, 64, generator=gen)
            with torch.no_grad():
                target = teacher(x)
            loss = (m(x) - target).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[fmt] = loss.item()
    assert losses["fp8_block"] < 0.2 * 1.0  # it learned (starting loss is about 1)
    assert abs(losses["fp8_block"] - losses["bf16"]) / losses["bf16"] < 0.03, losses


def test_shapes_the_format_cannot_hold_are_refused_at_start() -> None:
    m = DecoderNamedMlp(width=40)
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight: nvfp4 blocks of 16"):
        apply_train_precision(m, Contract("nvfp4", "nvfp4"))
    m = DecoderNamedMlp(width=40)  # kept in bf16 by an override: accepted, untouched
    names = apply_train_precision(m, Contract("nvfp4", "nvfp4",
                                              parse_overrides(["*.up_proj.weight=bf16"])))
    assert names == [] or not isinstance(m.model.layers[0].mlp.up_proj, LowPrecLinear)


@pytest.mark.parametrize("train,rollout,ok", [
    ("bf16", "bf16", True), ("bf16", "fp8_block", True), ("bf16", "mxfp8", True),
    ("fp8_block", "fp8_block", True), ("nvfp4", "nvfp4", True),
    ("bf16", "nvfp4", False), ("fp8_block", "mxfp8", False), ("mxfp8", "bf16", False)])
def test_contract_arrangements(train: str, rollout: str, ok: bool) -> None:
    p = contract_refusals(train, rollout, ())
    assert (p == []) == ok, p
    if train == "bf16" and rollout == "nvfp4":
        assert "use --precision nvfp4" in p[0]


def test_overrides_and_options_refused_where_they_break_the_contract() -> None:
    with pytest.raises(ValueError, match="PATTERN=FORMAT"):
        parse_overrides(["layers.0-1"])
    with pytest.raises(ValueError, match="empty"):
        parse_overrides(["layers.3-1=bf16"])
    assert contract_refusals("fp8_block", "fp8_block", (("lm_head*", "mxfp8"),))
    assert contract_refusals("fp8_block", "fp8_block", (), four_over_six=True)
    assert not contract_refusals("nvfp4", "nvfp4", (("layers.0-0", "bf16"),), four_over_six=True)
    c = Contract("fp8_block", "fp8_block", parse_overrides(["layers.0-1=bf16"]))
    assert c.tensor_format("model.layers.1.mlp.up_proj.weight", "train") == "bf16"
    assert c.tensor_format("model.layers.2.mlp.up_proj.weight", "rollout") == "fp8_block"
    assert c.tensor_format("lm_head.weight", "rollout") == "bf16"
    assert native_support("fp8_block", (9, 0)) and not native_support("nvfp4", (9, 0))
    assert native_support("nvfp4", (10, 0)) and not native_support("fp8_block", None)
