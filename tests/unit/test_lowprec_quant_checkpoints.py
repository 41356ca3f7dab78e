"""Serving and training from FP8 per-tensor / per-channel and INT4 pack-quantized checkpoints
(lowprec/quant_checkpoint.py, checkpoint_weights.py): each held exactly by an existing engine
store (the blockwise one with uniform tiles, the row-scaled fp8 one, the packed INT4 one) or
refused naming the setting or the tensor. The checkpoints are written by hand from the layouts'
definitions (milepost/testing/quant_checkpoints.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lowprec import experts_int4
from milepost.lowprec.checkpoint_weights import read_weight
from milepost.lowprec.engine_store import QuantizedLinear
from milepost.lowprec.quant_checkpoint import CheckpointQuant
from milepost.lowprec.quantize import dequantize
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.quant_checkpoints import (
    meaning,
    pack_int4_words,
    write_fp8,
    write_gptq,
    write_int4,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 160 and 272 input features: partial 128-wide tiles and groups, as real shapes rarely have.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qck") / "bf16", "qwen3", seed=3,
                                with_tokenizer=False, hidden_size=160, intermediate_size=272)


def _args(path: Path, **kw: object) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=8, max_total_tokens=256, **kw).resolved()


def _greedy(engine: object) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_outputs(engine, random_prompts((9, 5), seed=7), max_new_tokens=5)


def _dequantized_copy(src: Path, path: Path, dst: Path) -> Path:
    """An unquantized float32 checkpoint holding the weights `path` means (the trainer's load)."""
    dst.mkdir()
    model = load_model(path, torch.float32, "cpu")
    save_file({n: model.weight_view(n).contiguous() for n in model.hf_weight_names()
               if n != "lm_head.weight" or not model.tie_word_embeddings},
              dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def _quantized_names(out: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n.removesuffix("_scale") for n in out if n.endswith(".weight_scale"))


@pytest.mark.parametrize("style", ["hf", "compressed-tensors"])
def test_per_tensor_fp8_is_the_blockwise_store_with_uniform_tiles(src: Path, tmp_path: Path,
                                                                  style: str) -> None:
    out = write_fp8(src, tmp_path / "pt", "tensor", style)
    args = _args(tmp_path / "pt")
    assert args.quantization == "fp8_block"
    engine = build_engine(args)[0]
    model, store = engine.runner.model, engine.runner.model.fp8_weights
    names = _quantized_names(out)
    assert len(names) == 14
    trainer = load_model(tmp_path / "pt", torch.float32, "cpu")  # the FSDP trainer's load
    for n in names:
        m, j = store._part(model.weight_view(n))
        q = m.qparts[j][2]
        assert torch.equal(q.values.view(torch.uint8), out[n].view(torch.uint8)), n
        assert (q.scales == out[n.removesuffix("weight") + "weight_scale"].float()).all(), n
        assert torch.equal(dequantize(q), meaning(out, n)), n
        assert torch.equal(trainer.weight_view(n), meaning(out, n)), n
    # The same weights as a blockwise checkpoint whose every tile carries the tensor's scale.
    block = tmp_path / "blk"
    block.mkdir()
    t = dict(out)
    for n in names:
        s = t.pop(n.removesuffix("weight") + "weight_scale").float().reshape(1, 1)
        rows, cols = out[n].shape
        tiles = (-(-rows // 128), -(-cols // 128))
        t[n.removesuffix("weight") + "weight_scale_inv"] = s.expand(tiles).contiguous()
    save_file(t, block / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "pt" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (block / "config.json").write_text(json.dumps(cfg))
    assert _greedy(engine) == _greedy(build_engine(_args(block))[0])


def test_static_input_scales_of_a_per_tensor_checkpoint(src: Path, tmp_path: Path) -> None:
    """compressed-tensors' FP8 scheme (per-tensor weights, static per-tensor inputs): the
    static fp8_block engine with the checkpoint's input scales."""
    write_fp8(src, tmp_path / "st", "tensor", input_scale=0.0123)
    args = _args(tmp_path / "st")
    assert args.quantization == "fp8_block" and args.fp8_activation_scheme == "static"
    qkv = build_engine(args)[0].runner.model.model.layers[1].self_attn.qkv_proj
    assert qkv.qstatic and torch.equal(qkv.input_scale, torch.full((3,), 0.0123))


def test_the_trainer_loads_what_each_checkpoint_means(src: Path, tmp_path: Path) -> None:
    """The FSDP trainer's loader (fp32 master weights) and the Megatron reader's
    dequantize_state: the checkpoint's values times its scales, bit for bit."""
    from milepost.lowprec.fp8_checkpoint import dequantize_state

    for path, out, group in ((tmp_path / "pc", write_fp8(src, tmp_path / "pc", "channel"), 0),
                             (tmp_path / "i4", write_int4(src, tmp_path / "i4", 256), 256)):
        model = load_model(path, torch.float32, "cpu")
        state = dequantize_state(path, load_file(path / "model.safetensors"))
        assert not any(n.endswith(("_scale", "_packed", "_shape")) for n in state)
        for n in _quantized_names(out):
            assert torch.equal(model.weight_view(n), meaning(out, n, group)), n
            assert torch.equal(state[n], meaning(out, n, group)), n


def test_per_channel_fp8_is_the_row_scaled_store(src: Path, tmp_path: Path) -> None:
    out = write_fp8(src, tmp_path / "pc", "channel")
    args = _args(tmp_path / "pc", fp8_weight_only=True)  # W8A16 (W8A8: test_lowprec_fp8_dynamic.py)
    assert args.quantization == "fp8"  # the row-scaled store: values and row scales as stored
    engine = build_engine(args)[0]
    model = engine.runner.model
    for n in _quantized_names(out):
        view = model.weight_view(n)
        assert view.dtype == torch.float8_e4m3fn
        assert torch.equal(view.view(torch.uint8), out[n].view(torch.uint8)), n
        values, scale = model.fp8_weights.dequantized(view)
        assert torch.equal(scale, out[n.removesuffix("weight") + "weight_scale"].float().reshape(-1)), n
        assert torch.equal(values, meaning(out, n)), n
    # Weight-only (activations in --dtype): the same forward as the dequantized weights unquantized.
    plain = build_engine(_args(_dequantized_copy(src, tmp_path / "pc", tmp_path / "deq")))[0]
    assert _greedy(engine) == _greedy(plain)
    deq = build_engine(_args(tmp_path / "pc", dequantize_checkpoint=True))[0].runner.model
    n = "model.layers.1.mlp.down_proj.weight"
    assert not hasattr(deq, "fp8_weights") and torch.equal(deq.weight_view(n), meaning(out, n))


def test_per_channel_fp8_with_an_unquantized_projection_is_refused(src: Path, tmp_path: Path) -> None:
    """The row store quantizes every projection; one the checkpoint keeps in bf16 would not be
    served as stored."""
    write_fp8(src, tmp_path / "keep", "channel", keep=("model.layers.0.mlp",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight: stored unquantized"):
        build_engine(_args(tmp_path / "keep"))
    model = build_engine(_args(tmp_path / "keep", dequantize_checkpoint=True))[0].runner.model
    assert model.weight_view("model.layers.1.self_attn.q_proj.weight").dtype == torch.float32


@pytest.mark.parametrize(("layout", "group"), [("pack", 128), ("pack", 256), ("pack", 0),
                                               ("gptq", 128), ("gptq_v2", 256), ("gptq", 0)])
def test_int4_checkpoints_are_the_packed_int4_store(src: Path, tmp_path: Path, layout: str,
                                                    group: int) -> None:
    """compressed-tensors pack-quantized and GPTQ (v1 and v2): groups of 128, coarser groups
    (each 128-wide group takes its group's scale) and per-channel scales: the packed store holds
    the checkpoint's values; greedy decoding equals an engine on the dequantized weights (W4A16:
    activations stay in --dtype)."""
    out = (write_int4(src, tmp_path / "i4", group) if layout == "pack"
           else write_gptq(src, tmp_path / "i4", group, v1=layout == "gptq"))
    args = _args(tmp_path / "i4")
    assert args.quantization == "int4"
    engine = build_engine(args)[0]
    model, store = engine.runner.model, engine.runner.model.fp8_weights
    for n in _quantized_names(out):
        m, j = store._part(model.weight_view(n))
        assert m.weight.dtype == torch.uint8 and m.qparts[j][2].tile == (1, 128)
        values, _ = store.dequantized(model.weight_view(n))
        assert torch.equal(values, meaning(out, n, group)), n
    plain = build_engine(_args(_dequantized_copy(src, tmp_path / "i4", tmp_path / "deq")))[0]
    assert _greedy(engine) == _greedy(plain)


def test_int4_finer_groups_are_refused_as_stored_and_dequantized_on_request(src: Path,
                                                                          tmp_path: Path) -> None:
    out = write_int4(src, tmp_path / "g32", 32)
    with pytest.raises(ValueError, match="INT4 group_size 32; the engines' INT4 store has one "
                                         "float32 scale per 128"):
        ServerArgs(model_path=tmp_path / "g32", device="cpu").resolved()
    model = build_engine(_args(tmp_path / "g32", dequantize_checkpoint=True))[0].runner.model
    for n in _quantized_names(out):
        assert torch.equal(model.weight_view(n), meaning(out, n, 32)), n
    # --quantization int4 (a --precision int4 run): the dequantized weights re-quantized at load.
    requant = build_engine(_args(tmp_path / "g32", quantization="int4"))[0].runner.model
    assert isinstance(requant.model.layers[0].mlp.gate_up_proj, QuantizedLinear)


def test_int4_packing_by_definition() -> None:
    """An odd row width (a padded last word) and words with the sign bit set unpack to the
    values written; the engine's bytes are two's-complement nibbles, element 2i low."""
    v = torch.tensor([[7, -8, 0, 1, -1, 3, -3, 7, 5], [7] * 9], dtype=torch.int8)
    packed = pack_int4_words(v)
    assert packed.shape == (2, 2) and (packed[:, 0] < 0).all()  # 7 + 8 = 15 in the top nibble
    ckpt = CheckpointQuant("int4_pack", "none", (), ".weight_scale", 0)
    comp = {"x.weight_scale": torch.ones(2, 1), "x.weight_shape": torch.tensor([2, 9])}
    q = read_weight(ckpt, "x.weight", packed, comp.get)
    assert torch.equal(dequantize(q), v.float())
    assert q.values.shape == (2, 5) and q.values[0, 0].item() == (7 | ((-8 & 15) << 4))
    assert q.values[0, 4].item() == 5  # the padding nibble is zero, as the engine packs


@pytest.mark.parametrize("cols", [2048, 20, 6, 9])
def test_int4_words_read_as_bytes_are_the_packing_by_definition(cols: int) -> None:
    """Even widths take the bytes of the words (XOR 0x88), odd ones the unpacking by definition:
    both give the engine's packing of the values written, whatever the padding nibbles hold."""
    from milepost.lowprec import elements as el

    v = torch.randint(-8, 8, (5, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(cols))
    packed = pack_int4_words(v)
    if cols % 8:  # junk in the last word's padding nibbles: the reader must not take it
        packed[:, -1] |= torch.tensor(-1 << (4 * (cols % 8)), dtype=torch.int32)
    ckpt = CheckpointQuant("int4_pack", "none", (), ".weight_scale", 0)
    comp = {"x.weight_scale": torch.ones(5, 1), "x.weight_shape": torch.tensor([5, cols])}
    q = read_weight(ckpt, "x.weight", packed, comp.get)
    assert torch.equal(q.values, el.pack_int4(v)) and q.shape == (5, cols)
    assert torch.equal(dequantize(q), v.float())


@pytest.mark.parametrize("shape", [(256, 768), (3, 5), (1, 8)])
def test_gptq_words_read_as_bytes_are_the_packing_by_definition(shape: tuple[int, int]) -> None:
    """GPTQ's column-packed words, taken as bytes and transposed, give the engine's packing of
    the elements their definition unpacks (word i of column c: elements 8i..8i+7, unsigned)."""
    from milepost.lowprec import elements as el
    from milepost.lowprec.checkpoint_weights import _gptq_codes

    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=g)
    nibbles = torch.stack([(words.to(torch.int64) >> (4 * j)) & 15 for j in range(8)], dim=1)
    u = nibbles.reshape(shape[0] * 8, shape[1]).t()  # [out, in]: in-element 8i + j of each column
    assert torch.equal(_gptq_codes(words), el.pack_int4((u - 8).to(torch.int8)))


@pytest.mark.parametrize(("edit", "match"), [
    ({"actorder": "group"}, "actorder is 'group'"),
    ({"num_bits": 8}, "8-bit 'int'"),
    ({"strategy": "tensor", "group_size": None}, "strategy 'tensor'"),
])
def test_int4_settings_the_store_cannot_hold_are_refused(src: Path, tmp_path: Path, edit: dict,
                                                         match: str) -> None:
    write_int4(src, tmp_path / "b", 128)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(edit)
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        ServerArgs(model_path=tmp_path / "b", device="cpu")


@pytest.mark.parametrize(("edit", "match"), [
    ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme is set"),
    ({"quantization_status": "frozen"}, "quantization_status is 'frozen'"),
    ({"quant_method": "bitsandbytes"}, "quant_method is 'bitsandbytes'"),
    ({"group": {"strategy": "block", "block_structure": [64, 64]}}, r"block_structure is \[64, 64\]"),
    ({"inputs": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}},
     "per-channel FP8 weights with static input scales"),
])
def test_fp8_settings_the_stores_cannot_hold_are_refused(src: Path, tmp_path: Path, edit: dict,
                                                         match: str) -> None:
    write_fp8(src, tmp_path / "b", "channel")
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    qc, group = cfg["quantization_config"], cfg["quantization_config"]["config_groups"]["group_0"]
    group["weights"].update(edit.pop("group", {}))
    if "inputs" in edit:
        group["input_activations"] = edit.pop("inputs")
    qc.update(edit)
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        ServerArgs(model_path=tmp_path / "b", device="cpu")


@pytest.mark.parametrize("case", ["no scale", "scale shape", "zero point", "g_idx", "packed shape"])
def test_bad_tensors_are_refused_naming_them(src: Path, tmp_path: Path, case: str) -> None:
    int4 = case in ("zero point", "g_idx", "packed shape")
    path = tmp_path / "t"
    out = write_int4(src, path, 128) if int4 else write_fp8(src, path, "tensor")
    t = load_file(path / "model.safetensors")
    base = "model.layers.0.mlp.up_proj"
    if case == "no scale":
        del t[base + ".weight_scale"]
        match = f"{base}.weight is float8_e4m3fn but the checkpoint has no {base}.weight_scale"
    elif case == "scale shape":
        t[base + ".weight_scale"] = torch.ones(3)
        match = rf"{base}.weight_scale has shape \[3\]; a per-tensor"
    elif case == "zero point":
        t[base + ".weight_zero_point"] = torch.zeros(1, dtype=torch.int32)
        match = f"{base}.weight_zero_point: a zero point"
    elif case == "g_idx":
        k = out[base + ".values"].shape[1]
        t[base + ".weight_g_idx"] = (torch.arange(k) // 128).flip(0).to(torch.int32)
        match = f"{base}.weight_g_idx groups columns out of order"
    else:
        t[base + ".weight_packed"] = t[base + ".weight_packed"][:, :-1].contiguous()
        match = f"{base}.weight_packed is torch.int32"
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        build_engine(_args(path))
    with pytest.raises(ValueError, match=match):  # the trainer's loader alike
        load_model(path, torch.float32, "cpu")


def test_the_launcher_and_the_disk_update(src: Path, tmp_path: Path) -> None:
    """A bf16 rollout dequantizes (--dequantize-checkpoint); a disk update of such a checkpoint
    is refused naming the layout (an update sends values, not a store's encoding)."""
    from milepost.config import load_config
    from milepost.engine.weight_update import WeightLoader, WeightUpdateError
    from milepost.lowprec.rules import engine_precision_flags
    from milepost.testing.run_args import stub_run_args

    write_int4(src, tmp_path / "i4", 128)

    def cfg(*flags: str) -> object:
        args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4",
                             "--n-samples-per-prompt", "2", "--device", "cpu", *flags)
        args[args.index("--hf-checkpoint") + 1] = str(tmp_path / "i4")
        return load_config(None, args)

    assert engine_precision_flags(cfg()) == ["--dequantize-checkpoint"]  # bf16 engines
    assert engine_precision_flags(cfg("--precision", "int4")) == ["--quantization", "int4"]
    plain = build_engine(_args(src))[0].runner.model
    with pytest.raises(WeightUpdateError, match="a int4_pack checkpoint; /update_weights_from_disk"):
        WeightLoader(plain).from_disk(str(tmp_path / "i4"))


def test_moe_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-tensor FP8 experts go to the FP8 expert store as stored, INT4 experts to the packed
    INT4 expert store (lowprec/experts_int4.py) as stored, per-channel FP8 experts to the
    row-scaled store's (tests/unit/test_lowprec_moe_fp8_row.py)."""
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", seed=5, with_tokenizer=False)
    out = write_fp8(moe, tmp_path / "pt", "tensor")
    model = build_engine(_args(tmp_path / "pt"))[0].runner.model
    experts = [n for n in _quantized_names(out) if ".experts." in n]
    assert experts
    for n in experts:
        module, parts = model.fp8_weights.experts.parts(model.weight_view(n))
        q = module.qtensor(*parts[0])
        assert torch.equal(q.values.view(torch.uint8), out[n].view(torch.uint8)), n
        assert torch.equal(dequantize(q), meaning(out, n)), n
    out = write_int4(moe, tmp_path / "i4", 128)
    assert ServerArgs(model_path=tmp_path / "i4", device="cpu").resolved().quantization == "int4"
    calls: list[int] = []  # the stored experts' bytes go straight in: none packed from weights first
    quantize = experts_int4.quantize
    with monkeypatch.context() as m:
        m.setattr(experts_int4, "quantize", lambda *a, **kw: (calls.append(1), quantize(*a, **kw))[1])
        model = build_engine(_args(tmp_path / "i4"))[0].runner.model
    assert calls == []
    assert type(model.model.layers[0].mlp.experts).__name__ == "Int4StackedExperts"
    experts = [n.removesuffix("_packed") for n in out if ".experts." in n and n.endswith(".weight_packed")]
    assert len(experts) == 2 * 8 * 3
    for n in experts:  # every stored nibble (-8 included) and scale, as the checkpoint has them
        view = model.weight_view(n)
        assert model.fp8_weights.format_of(view) == "int4"
        values, _ = model.fp8_weights.dequantized(view)
        assert torch.equal(values, meaning(out, n, 128)), n
    deq = build_engine(_args(tmp_path / "i4", dequantize_checkpoint=True))[0].runner.model
    n = "model.layers.1.mlp.experts.1.up_proj.weight"
    assert torch.equal(deq.weight_view(n), meaning(out, n, 128))
    write_fp8(moe, tmp_path / "ch", "channel")
    assert ServerArgs(model_path=tmp_path / "ch", device="cpu").resolved().quantization == "fp8"


@pytest.mark.parametrize(("edit", "match"), [
    ({"dynamic": {"-:.*down_proj": {}}}, "dynamic sets per-module overrides"),
    ({"bits": 8}, "bits is 8"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format is 'marlin'"),
    ({"group_size": 32}, "INT4 group_size 32"),
])
def test_gptq_settings_the_store_cannot_hold_are_refused(src: Path, tmp_path: Path, edit: dict,
                                                         match: str) -> None:
    write_gptq(src, tmp_path / "g", 128)
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    cfg["quantization_config"].update(edit)
    (tmp_path / "g" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        ServerArgs(model_path=tmp_path / "g", device="cpu").resolved()


@pytest.mark.parametrize("case", ["zero", "v2 read as v1", "g_idx"])
def test_gptq_tensors_the_store_cannot_hold_are_refused(src: Path, tmp_path: Path, case: str) -> None:
    """An asymmetric zero point, a v2 checkpoint labelled v1 (every zero off by one), or
    columns grouped out of order (desc_act): refused naming the tensor."""
    path = tmp_path / "g"
    write_gptq(src, path, 128, v1=case != "v2 read as v1")
    if case == "v2 read as v1":
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"]["checkpoint_format"] = "gptq"
        (path / "config.json").write_text(json.dumps(cfg))
    t = load_file(path / "model.safetensors")
    base = "model.layers.1.mlp.down_proj"
    if case == "zero":
        t[base + ".qzeros"][0, 0] += 1  # the first column's zero 7 -> 8
    elif case == "g_idx":
        t[base + ".g_idx"] = t[base + ".g_idx"].flip(0).contiguous()
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    match = (f"{base}.g_idx groups columns out of order" if case == "g_idx" else
             rf"model\.layers\.\d\.\w+\.\w+_proj\.qzeros holds zero points other than 7" if case != "zero"
             else f"{base}.qzeros holds zero points other than 7")
    with pytest.raises(ValueError, match=match):
        load_model(path, torch.float32, "cpu")


def test_convert_hf_to_int4_serves_what_quantize_on_load_serves(src: Path, tmp_path: Path) -> None:
    """`milepost convert hf-to-int4` (compressed-tensors W4A16 from the shared quantizer) ->
    serve (int4 detected, as stored) = the bf16 source quantized on load: the same packed bytes
    and scales per tensor, the same greedy tokens and log-probs; layer 1 kept in bf16 (ignore)."""
    from milepost.cli import main

    dst = tmp_path / "int4"
    assert main(["convert", "hf-to-int4", str(src), str(dst), "--precision-override", "layers.1-1=bf16"]) == 0
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and "model.layers.1.mlp.down_proj" in qc["ignore"]
    args = _args(dst)
    assert args.quantization == "int4"
    a = build_engine(args)[0]
    b = build_engine(_args(src, quantization="int4", precision_override="layers.1-1=bf16"))[0]
    names = [n for n in a.runner.model.hf_weight_names() if ".layers.0." in n and n.split(".")[-2] in
             ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
    assert len(names) == 7
    for n in names:
        qa = a.runner.model.fp8_weights._part(a.runner.model.weight_view(n))
        qb = b.runner.model.fp8_weights._part(b.runner.model.weight_view(n))
        ta, tb = qa[0].qparts[qa[1]][2], qb[0].qparts[qb[1]][2]
        assert torch.equal(ta.values, tb.values) and torch.equal(ta.scales, tb.scales), n
    assert not isinstance(a.runner.model.model.layers[1].mlp.gate_up_proj, QuantizedLinear)
    assert _greedy(a) == _greedy(b)
