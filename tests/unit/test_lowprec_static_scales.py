"""Static FP8 input scales (`--fp8-activation-scheme static`): an fp8_block engine given the
delayed-scaling trainer's `<module>.input_scale` tensors quantizes its inputs exactly as the
trainer's forward does (bit for bit), follows each update's new scales, refuses unequal scales
for a fused projection, and the weight sync never rounds the float32 scales; checkpoint
conversion keeps a trainer export's scales (activation_scheme static) and a static engine
started on the export reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.contract import Contract
from milepost.lowprec.convert import main as convert_main
from milepost.lowprec.delayed import DelayedScaling, DelayedSettings, attach_delayed, qdq_input
from milepost.lowprec.engine_setup import store_engine_precision
from milepost.lowprec.engine_store import store_quantized
from milepost.lowprec.linear import apply_train_precision, quantize_activation
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.weights.codec import WeightUpdateError
from milepost.weights.sync import WeightSync

torch.set_num_threads(1)
FP8 = Contract("fp8_block", "fp8_block")
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("static") / "m", "qwen3", seed=3,
                                with_tokenizer=False)


def trainer(ckpt: Path) -> tuple[torch.nn.Module, DelayedScaling]:
    model = load_model(ckpt, torch.float32, "cpu")
    apply_train_precision(model, FP8)
    return model, attach_delayed(model, DelayedSettings(history_len=4), torch.device("cpu"))


def train_step(model: torch.nn.Module, state: DelayedScaling, gain: float, seed: int) -> None:
    """Every FP8 linear of layer 0 and 1 sees a training forward and backward (q/k/v one input,
    gate/up one input, as in the decoder), then the optimizer step's history update."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(2):
        for group in (PROJ[:3], PROJ[3:4], PROJ[4:6], PROJ[6:]):
            lin = [model.get_submodule(f"model.layers.{i}.{p}") for p in group]
            x = torch.randn(6, lin[0].in_features, generator=gen) * gain
            sum(m(x).square().sum() for m in lin).backward()
    state.step()


def engine(ckpt: Path):
    model = load_model(ckpt, torch.float32, "cpu")
    model.fuse_projections()
    return model, store_quantized(model, FP8, static_scales=True)


def test_engine_forward_equals_the_delayed_trainer_and_follows_updates(ckpt: Path) -> None:
    tm, state = trainer(ckpt)
    em, store = engine(ckpt)
    weights = list(load_file(ckpt / "model.safetensors").items())
    names = [n for n, _ in state.input_scales()]
    assert sorted(names) == sorted(store.input_scales.names())
    assert all(n.endswith(".input_scale") for n in names) and len(names) == 14
    x = torch.randn(5, 64) * 3
    # Version 0: no history on either side: both quantize per 1 x 128 block (current scaling).
    assert all(float(t) == 0.0 for _, t in state.input_scales())
    q = tm.get_submodule("model.layers.0.self_attn.q_proj")
    with torch.no_grad():  # (a forward under grad would record x's amax into q's slot alone)
        assert torch.equal(em.model.layers[0].self_attn.qkv_proj(x)[:, :q.out_features], q(x))
    for step, gain in enumerate((1.0, 40.0)):  # the second step's amaxes raise every scale
        train_step(tm, state, gain, seed=step)
        loader = WeightLoader(em)
        assert loader.from_named([*weights, *state.input_scales()]) == len(weights) + 14
        held = {n: em.weight_view(n) for n in names}
        for name, t in state.input_scales():
            assert t.dtype == torch.float32 and t.shape == () and float(t) > 0
            assert torch.equal(held[name], t)  # the engine follows the update's scales
        for i in range(2):
            layer = em.model.layers[i]
            for fused, parts in ((layer.self_attn.qkv_proj, PROJ[:3]),
                                 (layer.mlp.gate_up_proj, PROJ[4:6]),
                                 (layer.self_attn.o_proj, PROJ[3:4]),
                                 (layer.mlp.down_proj, PROJ[6:])):
                lin = [tm.get_submodule(f"model.layers.{i}.{p}") for p in parts]
                xi = torch.randn(7, lin[0].in_features) * 2
                slot = state.slot(f"model.layers.{i}.{parts[0]}.weight", "x")
                with torch.no_grad():  # a scoring pass: the trainer's forward, no record
                    want = torch.cat([m(xi) for m in lin], -1)
                    xq = state.qdq(xi, slot, record=False)
                    assert torch.equal(qdq_input(xi, fused.input_scale[0]), xq)
                    assert not torch.equal(xq, quantize_activation(xi, "fp8_block"))
                    got = fused(xi)
                # One GEMM on the engine for q/k/v: the same operands; unfused: the same bits.
                if len(parts) == 1:
                    assert torch.equal(got, want)
                else:
                    assert torch.equal(xq @ fused.weight.t(), got)
                    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_fused_projection_refuses_unequal_scales(ckpt: Path) -> None:
    em, _ = engine(ckpt)
    loader = WeightLoader(em)
    pre = "model.layers.0.self_attn."
    s = torch.tensor(0.01)
    with pytest.raises(WeightUpdateError, match=r"equal bit for bit.*k_proj.input_scale=0.0199"):
        loader.from_named([(f"{pre}q_proj.input_scale", s), (f"{pre}k_proj.input_scale", s * 2),
                           (f"{pre}v_proj.input_scale", s)])
    assert float(em.weight_view(f"{pre}q_proj.input_scale")) == 0.0  # nothing copied
    # Across requests of one update (buckets): q and k arrive, then v disagrees.
    loader.from_named([(f"{pre}q_proj.input_scale", s), (f"{pre}k_proj.input_scale", s)])
    with pytest.raises(WeightUpdateError, match="v_proj.input_scale"):
        loader.from_named([(f"{pre}v_proj.input_scale", s * 3)])
    loader.from_named([(f"{pre}v_proj.input_scale", s)])  # the update completes
    # The next update may change them all (q again: a new update).
    loader.from_named([(f"{pre}{p}_proj.input_scale", s * 5) for p in "qkv"])
    assert float(em.model.layers[0].self_attn.qkv_proj.input_scale.unique()) == float(s * 5)


def test_the_sync_keeps_scales_in_float32() -> None:
    sync = WeightSync(None, 1 << 20, dtype=torch.bfloat16)
    scale = torch.tensor(1.0 + 2.0**-20)  # not a bf16 value
    out = dict(sync._prepared(iter([("model.layers.0.mlp.down_proj.input_scale", scale),
                                    ("model.norm.weight", torch.ones(4))]), None))
    assert out["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(out["model.layers.0.mlp.down_proj.input_scale"], scale)


def test_a_checkpoint_with_trainer_scales_converts_static_and_loads(ckpt: Path, tmp_path: Path) -> None:
    """The trainer's HF export under delayed scaling holds the input scales: conversion keeps
    them (activation_scheme static) and a static engine started on either directory reads them."""
    tm, state = trainer(ckpt)
    train_step(tm, state, 1.0, seed=7)
    src = tmp_path / "export"
    shutil.copytree(ckpt, src)
    scales = dict(state.input_scales())
    save_file(scales, src / "scales.safetensors")
    dst = tmp_path / "fp8"
    convert_main([str(src), str(dst)])
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["activation_scheme"] == "static"
    converted = {n: t for f in dst.glob("*.safetensors") for n, t in load_file(f).items()}
    assert all(torch.equal(converted[n], t) for n, t in scales.items())  # float32, as sent
    # (This engine loads bf16/fp32 checkpoints, not converted FP8 ones: it reads the export.)
    em = load_model(src, torch.float32, "cpu")
    em.fuse_projections()
    args = SimpleNamespace(quantization="fp8_block", fp8_activation_scheme="static", model_path=src)
    store_engine_precision(em, args, torch.device("cpu"))
    for name, t in scales.items():
        assert torch.equal(em.weight_view(name), t), name
    bad = dict(scales)
    bad["model.layers.0.mlp.up_proj.input_scale"] = bad["model.layers.0.mlp.up_proj.input_scale"] * 2
    save_file(bad, src / "scales.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_up: unequal input scales"):
        convert_main([str(src), str(tmp_path / "refused")])


def test_the_hf_export_keeps_the_weights_dtype_beside_float32_scales(ckpt: Path, tmp_path: Path) -> None:
    from milepost.train.export import write_hf_directory

    scale = ("model.layers.0.mlp.down_proj.input_scale", torch.tensor(1.0 + 2.0**-20))
    named = [(n, t.bfloat16()) for n, t in load_file(ckpt / "model.safetensors").items()]
    write_hf_directory(iter([*named, scale]), ckpt, tmp_path / "hf")  # the scales come last
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")[scale[0]], scale[1])


def test_an_engine_without_static_scales_names_the_flag(ckpt: Path) -> None:
    model = load_model(ckpt, torch.float32, "cpu")
    model.fuse_projections()
    store_quantized(model, FP8)  # dynamic: no input scales
    with pytest.raises(WeightUpdateError, match="--fp8-activation-scheme static"):
        WeightLoader(model).from_named([("model.layers.0.mlp.down_proj.input_scale",
                                         torch.tensor(0.5))])
