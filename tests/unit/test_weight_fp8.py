"""fp8 weight storage (`--quantization fp8`): the format's error bound, and updates quantized on
arrival into fused projection rows with their own scales."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from milepost.engine.weight_fp8 import Fp8Linear, store_fp8
from milepost.engine.weight_update import WeightLoader, WeightUpdateError
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.weights.fp8 import FP8, dequantize_rows, fp8_error_bound, quantize_rows


def test_the_bound_holds_and_is_tight_over_normal_and_subnormal_values() -> None:
    gen = torch.Generator().manual_seed(0)
    # Columns spanning 7 decades: small entries of a row land in e4m3's subnormal range.
    x = torch.randn(64, 96, generator=gen) * torch.logspace(-6, 1, 96)
    x[3] = 0.0  # an all-zero row quantizes to exact zeros
    values, scale = quantize_rows(x.to(torch.bfloat16))
    assert values.dtype == FP8 and scale.shape == (64,)
    err = (dequantize_rows(values, scale) - x.to(torch.bfloat16).float()).abs()
    bound = fp8_error_bound(x.to(torch.bfloat16), scale)
    assert (err <= bound).all()
    assert not (err <= bound / 1.5).all()  # not a loose bound that anything passes
    assert (dequantize_rows(values, scale)[3] == 0).all()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "m", "qwen3", seed=1,
                                with_tokenizer=False)


def test_updates_quantize_on_arrival_into_fused_rows(ckpt: Path) -> None:
    model = load_model(ckpt, torch.float32, "cpu")
    model.fuse_projections()
    store = store_fp8(model)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and attn.qkv_proj.weight.dtype == FP8
    assert model.model.embed_tokens.weight.dtype == torch.float32  # only projections
    x = torch.randn(3, attn.qkv_proj.in_features)
    deq = dequantize_rows(attn.qkv_proj.weight, attn.qkv_proj.weight_scale)
    assert torch.allclose(attn.qkv_proj(x), F.linear(x, deq), atol=1e-5)

    sent = {n: t * 3.0 for n, t in load_file(ckpt / "model.safetensors").items()}
    loader = WeightLoader(model)
    assert loader.from_named(sent.items(), strict_dtype=True) == len(sent)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        view = model.weight_view(name)
        assert view.dtype == FP8
        values, scale = store.dequantized(view)
        # The slice's own rows' scales: k_proj's rows inside qkv_proj, up_proj's in gate_up_proj.
        assert torch.equal(scale, quantize_rows(sent[name])[1])
        assert ((values - sent[name]).abs() <= fp8_error_bound(sent[name], scale)).all()
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(model.weight_view(norm), sent[norm])  # unquantized: exact
    # The wire dtype is still the model's: fp8 or another dtype is refused, nothing written.
    with pytest.raises(WeightUpdateError, match="model expects torch.float32"):
        loader.from_named([("model.layers.0.self_attn.q_proj.weight",
                            sent["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16))],
                          strict_dtype=True)


def test_fp8_weights_are_found_again_after_their_memory_moves(ckpt: Path) -> None:
    """Released and resumed weights (engine/memory.py resizes storages) get new addresses."""
    model = load_model(ckpt, torch.float32, "cpu")
    store_fp8(model)
    name = "model.layers.0.mlp.down_proj.weight"
    original = load_file(ckpt / "model.safetensors")[name]
    assert WeightLoader(model).from_named([(name, original)], strict_dtype=True) == 1
    storage = model.weight_view(name).untyped_storage()
    before = storage.data_ptr()
    host = torch.empty(storage.nbytes(), dtype=torch.uint8).untyped_storage()
    host.copy_(storage)
    storage.resize_(0)
    blockers = []  # each takes the block just freed, so the allocator must hand out another
    for _ in range(8):
        blockers.append(torch.empty(host.nbytes(), dtype=torch.uint8))
        storage.resize_(host.nbytes())
        if storage.data_ptr() != before:
            break
        storage.resize_(0)
    storage.copy_(host)
    sent = original * 2.0
    assert WeightLoader(model).from_named([(name, sent)], strict_dtype=True) == 1
    values, scale = model.fp8_weights.dequantized(model.weight_view(name))
    assert ((values - sent).abs() <= fp8_error_bound(sent, scale)).all()
    assert before != storage.data_ptr()  # it did move
