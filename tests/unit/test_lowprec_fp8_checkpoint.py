"""Serving and training from FP8 blockwise checkpoints (lowprec/fp8_checkpoint.py): milepost's
own conversion and the public DeepSeek-V3 / Qwen3-FP8 layout (`weight_scale_inv`) load their
values and scales as stored; unsupported layouts are refused at start naming the setting."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.config import ConfigError, load_config
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lowprec.contract import Contract
from milepost.lowprec.convert import convert_checkpoint
from milepost.lowprec.engine_store import QuantizedLinear
from milepost.lowprec.quantize import QTensor, dequantize, quantize
from milepost.lowprec.rules import engine_precision_flags
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.run_args import stub_run_args

torch.set_num_threads(1)
COVERED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 160 x 272: two and three 128-tiles with partial edge tiles (ceil, as DeepSeek's scales).
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8ck") / "bf16", "qwen3", seed=3,
                                with_tokenizer=False, hidden_size=160, intermediate_size=272)


@pytest.fixture(scope="module")
def converted(src: Path) -> Path:
    """milepost's FP8 export (`milepost convert hf-to-fp8`), layer 1 kept in bf16
    (modules_to_not_convert)."""
    from milepost.cli import main

    dst = src.parent / "fp8"
    assert main(["convert", "hf-to-fp8", str(src), str(dst), "--precision-override", "layers.1-1=bf16"]) == 0
    return dst


def _args(path: Path, **kw: object) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=8, max_total_tokens=256, **kw).resolved()


def _greedy(engine: object) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_outputs(engine, random_prompts((9, 5), seed=7), max_new_tokens=5)


def _qtensors(engine: object) -> dict[str, QTensor]:
    model = engine.runner.model
    store = model.fp8_weights
    out = {}
    for n in model.hf_weight_names():
        view = model.weight_view(n)
        if store.experts is not None and store.experts.owner(view) is not None:
            module, parts = store.experts.parts(view)
            if len(parts) == 1:
                out[n] = module.qtensor(*parts[0])
        elif store.owner(view) is not None:
            m, j = store._part(view)
            out[n] = m.qparts[j][2]
    return out


def test_converted_checkpoint_serves_what_quantize_on_load_serves(src: Path, converted: Path) -> None:
    """`convert` -> serve (fp8_block detected) = the bf16 source quantized on load: the same
    float8 bits and scales per tensor, the same greedy tokens and log-probs."""
    args = _args(converted)
    assert args.quantization == "fp8_block" and args.fp8_activation_scheme == "dynamic"
    from_ckpt = build_engine(args)[0]
    on_load = build_engine(_args(src, quantization="fp8_block", precision_override="layers.1-1=bf16"))[0]
    a, b = _qtensors(from_ckpt), _qtensors(on_load)
    assert a.keys() == b.keys() and a and not any(".layers.1." in n for n in a)
    for n in a:
        assert torch.equal(a[n].values.view(torch.uint8), b[n].values.view(torch.uint8)), n
        assert torch.equal(a[n].scales, b[n].scales), n
    layer1 = from_ckpt.runner.model.model.layers[1].mlp.gate_up_proj
    assert type(layer1) is not QuantizedLinear  # modules_to_not_convert: kept as stored
    assert _greedy(from_ckpt) == _greedy(on_load)


def _public_layout(src: Path, dst: Path, static: bool = False,
                   quantized: Callable[[str, torch.Tensor], bool] | None = None) -> dict[str, torch.Tensor]:
    """A Qwen3-FP8 / DeepSeek-V3 style checkpoint written by hand: random E4M3 codes and tile
    scales that are not amax / 448 (no milepost quantizer involved); layer 0's MLP and lm_head
    left in bf16 (modules_to_not_convert). Returns the tensors written."""
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(11)
    out: dict[str, torch.Tensor] = {}
    for n, t in load_file(src / "model.safetensors").items():
        module = n.removesuffix(".weight").rsplit(".", 1)[-1]
        if not (quantized(n, t) if quantized else module in COVERED and ".layers.0.mlp." not in n):
            out[n] = t
            continue
        codes = torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
        out[n] = codes.view(torch.float8_e4m3fn)
        tiles = (-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        out[n.removesuffix("weight") + "weight_scale_inv"] = torch.rand(tiles, generator=g) * 1e-3 + 1e-5
        if static:
            out[n.removesuffix("weight") + "input_scale"] = torch.tensor(0.0123)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "static" if static else "dynamic",
                                  "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return out


def _expected(out: dict[str, torch.Tensor], n: str) -> torch.Tensor:
    """weight * weight_scale_inv per 128 x 128 tile, written here from the layout's definition."""
    w, s = out[n].float(), out[n.removesuffix("weight") + "weight_scale_inv"]
    s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
    return w * s


def test_public_layout_loads_its_values_in_engine_and_trainer(src: Path, tmp_path: Path) -> None:
    out = _public_layout(src, tmp_path / "pub")
    engine = build_engine(_args(tmp_path / "pub"))[0]
    qs = _qtensors(engine)
    fp8_names = [n for n, t in out.items() if t.dtype == torch.float8_e4m3fn]
    assert sorted(qs) == sorted(fp8_names)
    for n in fp8_names:  # the stored bytes and scales, no round trip
        assert torch.equal(qs[n].values.view(torch.uint8), out[n].view(torch.uint8)), n
        assert torch.equal(qs[n].scales, out[n.removesuffix("weight") + "weight_scale_inv"]), n
        assert torch.equal(dequantize(qs[n]), _expected(out, n)), n
    store = engine.runner.model.fp8_weights
    for n in fp8_names:  # the emulated linears multiply exactly those values
        m, j = store._part(engine.runner.model.weight_view(n))
        row, rows, _ = m.qparts[j]
        assert not m.native and torch.equal(m.weight[row:row + rows], _expected(out, n)), n
    assert type(engine.runner.model.model.layers[0].mlp.gate_up_proj) is not QuantizedLinear
    # The trainer's load (fp32 master weights): the same dequantized values, bit for bit.
    lm = load_model(tmp_path / "pub", torch.float32, "cpu")
    for n in fp8_names:
        assert torch.equal(lm.weight_view(n), _expected(out, n)), n
    assert torch.equal(lm.weight_view("model.layers.0.mlp.up_proj.weight"),
                       out["model.layers.0.mlp.up_proj.weight"])


def test_static_activation_scales_map_onto_the_static_engine(src: Path, tmp_path: Path) -> None:
    _public_layout(src, tmp_path / "st", static=True)
    args = _args(tmp_path / "st")
    assert args.fp8_activation_scheme == "static"
    model = build_engine(args)[0].runner.model
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.qstatic and torch.equal(qkv.input_scale, torch.full((3,), 0.0123))
    # Explicitly dynamic (the trainer's launcher under current scaling): the scales stay unused.
    model = build_engine(_args(tmp_path / "st", fp8_activation_scheme="dynamic"))[0].runner.model
    assert not model.model.layers[1].self_attn.qkv_proj.qstatic


def test_dequantize_checkpoint_serves_the_dequantized_weights(converted: Path) -> None:
    model = build_engine(_args(converted, dequantize_checkpoint=True))[0].runner.model
    assert not hasattr(model, "fp8_weights")
    out = load_file(converted / "model.safetensors")
    n = "model.layers.0.mlp.down_proj.weight"
    q = QTensor("fp8_block", out[n], out[n.removesuffix("weight") + "weight_scale_inv"], (128, 128),
                tuple(out[n].shape))
    assert torch.equal(model.weight_view(n), dequantize(q))


def test_requantizing_the_dequantized_checkpoint(converted: Path, src: Path, tmp_path: Path) -> None:
    """bf16-train-fp8-serve from an FP8 checkpoint: the engines re-quantize what the trainer
    sends. From the fp32 master (dequantized) milepost's own export comes back bit for bit
    (each tile's amax maps to 448 exactly); a tile whose largest code is below 448 (public
    checkpoints quantized otherwise) gets a finer scale, so the values move within the bound."""
    out = load_file(converted / "model.safetensors")
    for n in [k for k, t in out.items() if t.dtype == torch.float8_e4m3fn]:
        q = QTensor("fp8_block", out[n], out[n.removesuffix("weight") + "weight_scale_inv"],
                    (128, 128), tuple(out[n].shape))
        again = quantize(dequantize(q), "fp8_block")
        assert torch.equal(again.values.view(torch.uint8), q.values.view(torch.uint8)), n
        assert torch.equal(again.scales, q.scales), n
    pub = _public_layout(src, tmp_path / "pub")
    n = "model.layers.1.mlp.up_proj.weight"
    q = QTensor("fp8_block", pub[n], pub[n.removesuffix("weight") + "weight_scale_inv"], (128, 128),
                tuple(pub[n].shape))
    q.values[:, :] = (q.values.float() * 0.5).to(torch.float8_e4m3fn)  # every tile's amax < 448
    again = quantize(dequantize(q), "fp8_block")
    assert not torch.equal(again.scales, q.scales)
    assert (dequantize(again) - dequantize(q)).abs().le(
        dequantize(q).abs() * 2.0**-4 + again.scales.max() * 2.0**-10).all()


def test_transformers_reads_the_same_values(tmp_path: Path) -> None:
    """transformers' finegrained-FP8 loader on CPU dequantizes (it needs a GPU for FP8 GEMMs):
    its weights equal ours. Single-tile tensors: transformers derives the block from the scale
    grid (rows // scale rows), which equals 128 x 128 with ceil only when the tile count fits."""
    from transformers import AutoModelForCausalLM

    small = make_tiny_checkpoint(tmp_path / "s", "qwen3", seed=4, with_tokenizer=False)
    convert_checkpoint(small, tmp_path / "f", Contract("fp8_block", "fp8_block"))
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "f", dtype=torch.float32).eval()
    ours = load_model(tmp_path / "f", torch.float32, "cpu")
    checked = 0
    for n, p in ref.state_dict().items():
        if n.split(".")[-2] in COVERED:
            assert torch.equal(p.float(), ours.weight_view(n)), n
            checked += 1
    assert checked == 7 * 2


@pytest.mark.parametrize(("edit", "match"), [
    ({"weight_block_size": [64, 64]}, r"weight_block_size is \[64, 64\]"),
    ({"fmt": "e5m2"}, "fmt is 'e5m2'"),
    ({"quant_method": "bitsandbytes"}, "quant_method is 'bitsandbytes'"),
    ({"activation_scheme": "per_token"}, "activation_scheme is 'per_token'"),
])
def test_layouts_the_engines_cannot_hold_are_refused_at_start(converted: Path, tmp_path: Path,
                                                              edit: dict, match: str) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(converted, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"].update(edit)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        ServerArgs(model_path=bad, device="cpu")


def test_bad_tensors_are_refused_naming_them(converted: Path, tmp_path: Path) -> None:
    n = "model.layers.0.mlp.up_proj.weight_scale_inv"
    for case, match in (("missing", f"no {n}"), ("shape", rf"{n} has shape \[1, 1\]")):
        bad = tmp_path / case
        shutil.copytree(converted, bad)
        t = load_file(bad / "model.safetensors")
        if case == "missing":
            del t[n]
        else:
            t[n] = t[n][:1, :1].clone()
        save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            build_engine(_args(bad))
    with pytest.raises(ValueError, match="has no quantization_config"):
        ServerArgs(model_path=converted.parent / "bf16", dequantize_checkpoint=True)
    with pytest.raises(ValueError, match="--dequantize-checkpoint with --quantization"):
        ServerArgs(model_path=converted, dequantize_checkpoint=True, quantization="fp8_block")


def test_training_runs_decide_what_the_engines_get(converted: Path, tmp_path: Path) -> None:
    def cfg(*flags: str) -> object:
        args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4",
                             "--n-samples-per-prompt", "2", "--device", "cpu", *flags)
        args[args.index("--hf-checkpoint") + 1] = str(converted)
        return load_config(None, args)

    assert engine_precision_flags(cfg()) == ["--dequantize-checkpoint"]  # bf16 engines
    assert engine_precision_flags(cfg("--precision", "bf16-train-fp8-serve")) == [
        "--quantization", "fp8_block", "--fp8-activation-scheme", "dynamic"]
    # An FP8 trainer would quantize the layer the checkpoint keeps in bf16: refused with the fix.
    with pytest.raises(ConfigError, match=r"keeps model\.layers\.1\..* add --precision-override"):
        cfg("--precision", "fp8")
    c = cfg("--precision", "fp8", "--precision-override", "layers.1-1=bf16")
    assert "--quantization" in engine_precision_flags(c)


def test_moe_experts_load_as_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A converted Qwen3-MoE checkpoint: the engine's FP8 experts hold the checkpoint's bytes,
    the same as an engine that quantized the bf16 source on load; the stored start quantizes no
    expert first (the bytes go straight into the store's buffers)."""
    from milepost.lowprec import engine_experts

    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", seed=5, with_tokenizer=False)
    convert_checkpoint(moe, tmp_path / "moe8", Contract("fp8_block", "fp8_block"))
    stored = load_file(tmp_path / "moe8" / "model.safetensors")
    calls: list[int] = []
    quantize = engine_experts.quantize
    with monkeypatch.context() as m:
        m.setattr(engine_experts, "quantize", lambda *a, **kw: (calls.append(1), quantize(*a, **kw))[1])
        a = build_engine(_args(tmp_path / "moe8"))[0].runner.model
        assert calls == []
        b = build_engine(_args(moe, quantization="fp8_block"))[0].runner.model
        assert calls  # from bf16 it does quantize them
    names = [n for n in stored if ".experts." in n and n.endswith(".weight")]
    assert names and all(stored[n].dtype == torch.float8_e4m3fn for n in names)
    for n in names:
        for m in (a, b):
            module, parts = m.fp8_weights.experts.parts(m.weight_view(n))
            q = module.qtensor(*parts[0])
            assert torch.equal(q.values.view(torch.uint8), stored[n].view(torch.uint8)), n
            assert torch.equal(q.scales, stored[n.removesuffix("weight") + "weight_scale_inv"]), n


def test_megatron_reader_dequantizes(src: Path, tmp_path: Path) -> None:
    from milepost.train.megatron.provider import read_hf_weights

    out = _public_layout(src, tmp_path / "pub")
    got = read_hf_weights(tmp_path / "pub")
    assert not any(n.endswith("weight_scale_inv") for n in got)
    for n, t in out.items():
        if t.dtype == torch.float8_e4m3fn:
            assert torch.equal(got[n], _expected(out, n)), n


def test_deepseek_v3_layout(tmp_path: Path) -> None:
    """DeepSeek-V3 as shipped: every 2-d linear of the layers in FP8, MLA's too (q_a / q_b /
    kv_a / kv_b: outside milepost's recipe, so the engine dequantizes them into the model
    dtype), the router in bf16; the dense MLP and shared experts served from their FP8 bytes."""
    from milepost.testing.hf_archs import make_tiny_hf_checkpoint

    ds = make_tiny_hf_checkpoint(tmp_path / "ds", "deepseek_v3", seed=6)
    out = _public_layout(Path(ds), tmp_path / "ds8", quantized=lambda n, t: (
        ".layers." in n and n.endswith("_proj.weight") and t.dim() == 2))
    fp8 = [n for n, t in out.items() if t.dtype == torch.float8_e4m3fn]
    assert any("kv_b_proj" in n for n in fp8) and any("shared_experts" in n for n in fp8)
    model = build_engine(_args(tmp_path / "ds8"))[0].runner.model
    qs = _qtensors(type("E", (), {"runner": type("R", (), {"model": model})})())
    for n in fp8:
        if n in qs:  # served as stored
            assert torch.equal(qs[n].values.view(torch.uint8), out[n].view(torch.uint8)), n
        else:  # outside the recipe: dequantized into the model dtype (float32 here: exact)
            assert torch.equal(model.weight_view(n), _expected(out, n)), n
    assert any("shared_experts" in n for n in qs) and any(".experts.0." in n for n in qs)
    assert not any("kv_b_proj" in n for n in qs)
    assert len(_greedy(build_engine(_args(tmp_path / "ds8"))[0])[0][0]) == 5


def test_update_weights_from_disk_takes_an_fp8_checkpoint(src: Path, converted: Path, tmp_path: Path) -> None:
    """/update_weights_from_disk with an FP8 checkpoint: each float8 weight arrives dequantized
    (its scale applied) and is stored as any update: a bf16 engine holds the dequantized values,
    an fp8_block engine re-quantizes them, which gives milepost's export back bit for bit."""
    from milepost.engine.weight_update import WeightLoader
    from milepost.weights.codec import WeightUpdateError

    out = load_file(converted / "model.safetensors")
    fp8 = build_engine(_args(src, quantization="fp8_block", precision_override="layers.1-1=bf16"))[0]
    assert WeightLoader(fp8.runner.model).from_disk(str(converted)) > 0
    want = _qtensors(build_engine(_args(converted))[0])
    for n, q in _qtensors(fp8).items():
        assert torch.equal(q.values.view(torch.uint8), want[n].values.view(torch.uint8)), n
        assert torch.equal(q.scales, want[n].scales), n
    plain = build_engine(_args(src))[0].runner.model
    WeightLoader(plain).from_disk(str(converted))
    n = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(plain.weight_view(n), dequantize(want[n]))
    bad = tmp_path / "bad"
    shutil.copytree(converted, bad)
    t = load_file(bad / "model.safetensors")
    del t["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(t, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightUpdateError, match="no model.layers.0.mlp.up_proj.weight_scale_inv"):
        WeightLoader(plain).from_disk(str(bad))


def test_scales_in_another_shard(converted: Path, tmp_path: Path) -> None:
    """Large checkpoints are sharded: a weight's weight_scale_inv may sit in another file."""
    split = tmp_path / "split"
    shutil.copytree(converted, split)
    t = load_file(split / "model.safetensors")
    (split / "model.safetensors").unlink()
    save_file({n: v for n, v in t.items() if not n.endswith("weight_scale_inv")},
              split / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({n: v for n, v in t.items() if n.endswith("weight_scale_inv")},
              split / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    a, b = _qtensors(build_engine(_args(split))[0]), _qtensors(build_engine(_args(converted))[0])
    assert a.keys() == b.keys() and all(torch.equal(a[n].scales, b[n].scales) for n in a)


def test_fp8_config_without_float8_weights_is_refused(src: Path, tmp_path: Path) -> None:
    bad = tmp_path / "cfg_only"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no weight is float8_e4m3fn: remove quantization_config"):
        build_engine(_args(bad))


def test_hf_to_megatron_from_fp8_drops_the_fp8_config(converted: Path, tmp_path: Path) -> None:
    from milepost.convert import hf_to_megatron_dir
    from milepost.train.megatron.parallel import ParallelSizes

    hf_to_megatron_dir(converted, tmp_path / "meg", ParallelSizes(tp=1, pp=1, ep=1))
    assert "quantization_config" not in json.loads((tmp_path / "meg" / "hf" / "config.json").read_text())


@pytest.mark.parametrize("fmt", ["mxfp8", "fp8"])
def test_other_formats_quantize_the_dequantized_checkpoint(converted: Path, fmt: str) -> None:
    """`--quantization mxfp8` (a --precision mxfp8 run from an FP8 checkpoint), or per-row fp8:
    the dequantized weights are quantized at load, as a bf16 checkpoint's would be."""
    # down_proj's 272 input features are no multiple of MX's 32: kept bf16 (refused otherwise).
    kw = {"precision_override": "*.down_proj.weight=bf16"} if fmt == "mxfp8" else {}
    model = build_engine(_args(converted, quantization=fmt, **kw))[0].runner.model
    out = load_file(converted / "model.safetensors")
    n = "model.layers.0.self_attn.q_proj.weight"
    deq = dequantize(QTensor("fp8_block", out[n], out[n.removesuffix("weight") + "weight_scale_inv"],
                             (128, 128), tuple(out[n].shape)))
    if fmt == "mxfp8":
        assert torch.equal(model.fp8_weights.dequantized(model.weight_view(n))[0],
                           dequantize(quantize(deq, "mxfp8")))
    else:
        assert model.weight_view(n).dtype == torch.float8_e4m3fn


def test_deepseek_v3_with_an_mtp_layer(tmp_path: Path) -> None:
    """DeepSeek ships its MTP layer in FP8 too: the trainer and the engine (NEXTN drafting
    included) load it; what the FP8 store does not hold stays dequantized, exactly."""
    from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint

    src = make_tiny_mtp_checkpoint(tmp_path / "src", seed=1)
    out = _public_layout(Path(src), tmp_path / "fp8", quantized=lambda n, t: (
        ".layers." in n and n.endswith("_proj.weight") and t.dim() == 2))
    load_model(tmp_path / "fp8", torch.float32, "cpu")
    engine = build_engine(_args(tmp_path / "fp8", speculative_algorithm="NEXTN", speculative_num_steps=1,
                                speculative_eagle_topk=1, speculative_num_draft_tokens=2))[0]
    qs, model = _qtensors(engine), engine.runner.model
    for n, t in out.items():
        if t.dtype == torch.float8_e4m3fn and n not in qs:
            assert torch.equal(model.weight_view(n), _expected(out, n)), n
    assert qs
