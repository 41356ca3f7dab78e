"""The engine's low-precision weights (`--quantization fp8_block|mxfp8|nvfp4`): quantized per HF
tensor at load and on every update by the one quantizer, bit-identical to what the trainer's
quantized linears use; NVFP4 gate/up share one outer scale."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.contract import Contract, parse_overrides
from milepost.lowprec.engine_store import QuantizedLinear, store_quantized
from milepost.lowprec.linear import LowPrecLinear, apply_train_precision
from milepost.lowprec.quantize import dequantize, element_scale, error_bound, quantize
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lowprec") / "m", "qwen3", seed=2,
                                with_tokenizer=False)


def engine_model(ckpt: Path, contract: Contract):
    model = load_model(ckpt, torch.float32, "cpu")
    model.fuse_projections()
    return model, store_quantized(model, contract)


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "nvfp4", "int4"])
def test_updates_requantize_each_tensor_on_arrival(ckpt: Path, fmt: str) -> None:
    contract = Contract(fmt, fmt)
    model, store = engine_model(ckpt, contract)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantizedLinear) and len(attn.qkv_proj.qparts) == 3
    sent = {n: t * 2.5 + 0.01 for n, t in load_file(ckpt / "model.safetensors").items()}
    assert WeightLoader(model).from_named(sent.items(), strict_dtype=True) == len(sent)
    k = "model.layers.0.self_attn.k_proj.weight"
    values, scale = store.dequantized(model.weight_view(k))
    assert torch.equal(values, dequantize(quantize(sent[k], fmt)))  # its own blocks, same bits
    assert ((values - sent[k]).abs() <= error_bound(fmt, sent[k], scale)).all()
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(model.weight_view(norm), sent[norm])  # not covered: exact
    out = model.model.layers[0].self_attn.qkv_proj(torch.randn(3, 64))
    assert torch.isfinite(out).all()


def test_engine_and_trainer_hold_the_same_quantized_values(ckpt: Path) -> None:
    """The contract: trainer forward and engine see identical values (nvfp4 + four-over-six,
    gate/up with one outer scale, an override kept in bf16 at both stages)."""
    contract = Contract("nvfp4", "nvfp4", parse_overrides(["layers.1-1=bf16"]), four_over_six=True)
    model, store = engine_model(ckpt, contract)
    trainer = load_model(ckpt, torch.float32, "cpu")
    names = apply_train_precision(trainer, contract)
    assert names and all(".layers.0." in n for n in names)
    assert not isinstance(trainer.model.layers[1].mlp.up_proj, LowPrecLinear)
    for short in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        hf = f"model.layers.0.{short}.weight"
        lin = trainer.get_submodule(f"model.layers.0.{short}")
        assert torch.equal(store.dequantized(model.weight_view(hf))[0], lin.quantized_weight())
    gate = "model.layers.0.mlp.gate_proj.weight"
    joint = store.dequantized(model.weight_view(gate))[1]
    up_alone = element_scale(quantize(trainer.get_submodule("model.layers.0.mlp.up_proj").weight,
                                      "nvfp4", four_over_six=True))
    assert joint.shape == up_alone.shape
    assert type(model.model.layers[1].mlp.gate_up_proj) is torch.nn.Linear  # override: bf16
    # The forward too: the same quantized activations (per token, four-over-six) on both sides.
    x = torch.randn(5, 64)
    gate_engine = model.model.layers[0].mlp.gate_up_proj(x)[:, :128]
    gate_trainer = trainer.get_submodule("model.layers.0.mlp.gate_proj")(x)
    assert torch.allclose(gate_engine, gate_trainer, rtol=1e-5, atol=1e-5)


def test_nvfp4_gate_waits_for_up_then_both_share_the_outer_scale(ckpt: Path) -> None:
    model, store = engine_model(ckpt, Contract("nvfp4", "nvfp4"))
    w = load_file(ckpt / "model.safetensors")
    gate, up = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"
    before = store.dequantized(model.weight_view(gate))[0].clone()
    loader = WeightLoader(model)
    loader.from_named([(gate, w[gate] * 100)], strict_dtype=True)
    assert torch.equal(store.dequantized(model.weight_view(gate))[0], before)  # waiting for up
    loader.from_named([(up, w[up])], strict_dtype=True)
    g = store.dequantized(model.weight_view(gate))
    u = store.dequantized(model.weight_view(up))
    module = model.model.layers[0].mlp.gate_up_proj
    assert module.qparts[0][2].tensor_scale == module.qparts[1][2].tensor_scale
    assert ((g[0] - w[gate] * 100).abs() <= error_bound("nvfp4", w[gate] * 100, g[1])).all()
    assert ((u[0] - w[up]).abs() <= error_bound("nvfp4", w[up], u[1])).all()


def test_checkpoint_conversion_writes_the_quantizers_values(ckpt: Path, tmp_path: Path) -> None:
    """The fourth stage: the converted checkpoint holds exactly what the engine would store."""
    import json

    from milepost.lowprec.convert import convert_checkpoint

    contract = Contract("fp8_block", "fp8_block", parse_overrides(["layers.1-1=bf16"]))
    names = convert_checkpoint(ckpt, tmp_path / "fp8", contract)
    assert names and all(".layers.0." in n for n in names)
    out = load_file(tmp_path / "fp8" / "model.safetensors")
    src = load_file(ckpt / "model.safetensors")
    up = "model.layers.0.mlp.up_proj.weight"
    q = quantize(src[up], "fp8_block")
    assert out[up].dtype == torch.float8_e4m3fn and torch.equal(out[up].view(torch.uint8),
                                                                q.values.view(torch.uint8))
    assert torch.equal(out["model.layers.0.mlp.up_proj.weight_scale_inv"], q.scales)
    assert torch.equal(out["model.layers.1.mlp.up_proj.weight"], src["model.layers.1.mlp.up_proj.weight"])
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    model, store = engine_model(ckpt, contract)
    assert torch.equal(store.dequantized(model.weight_view(up))[0],
                       out[up].float() * element_scale(q))
    with pytest.raises(ValueError, match="no common checkpoint layout"):
        convert_checkpoint(ckpt, tmp_path / "x", Contract("nvfp4", "nvfp4"))
