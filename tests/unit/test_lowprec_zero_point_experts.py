"""MoE experts with zero points served as stored: a tiny Qwen3-MoE checkpoint in AWQ (AutoAWQ's gemm
layout), asymmetric GPTQ (`sym: false`) and compressed-tensors pack-quantized with `symmetric:
false`, written by hand from the layouts' definitions (milepost/testing/quant_checkpoints*.py:
random codes, zeros and scales), starts an engine whose INT4 expert store keeps each group's zero
point beside its scale; its greedy tokens and log-probs equal an engine started with
--dequantize-checkpoint (the checkpoint's meaning in --dtype). compressed-tensors zero points are
read for dense linears too. Updates re-quantize symmetric (zero points 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.experts_int4 import Int4StackedExperts
from milepost.lowprec.quantize import dequantize, quantize
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.quant_checkpoints import meaning, write_awq, write_gptq
from milepost.testing.quant_checkpoints_zero import write_int4_asym
from milepost.testing.whole_start import quantize_after_build, served_args

torch.set_num_threads(1)
EXPERT = "model.layers.1.mlp.experts.3.{}_proj.weight"


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 160 and expert width 136: partial 128-wide groups on both expert GEMMs' K.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("zmoe") / "bf16", "qwen3_moe", seed=5,
                                with_tokenizer=False, hidden_size=160, moe_intermediate_size=136)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("zdense") / "bf16", "qwen3", seed=3,
                                with_tokenizer=False, hidden_size=160, intermediate_size=272)


def _write(kind: str, src: Path, dst: Path, group: int = 128) -> dict[str, torch.Tensor]:
    if kind == "awq":
        return write_awq(src, dst, group)
    if kind == "gptq":
        return write_gptq(src, dst, group, v1=True, sym=False)
    return write_int4_asym(src, dst, group)


def _args(path: Path, dtype: str = "float32", **kw: object) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", dtype=dtype, page_size=4,
                      chunked_prefill_size=8, max_total_tokens=256, **kw).resolved()


def _greedy(engine: object) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_outputs(engine, random_prompts((9, 5, 12), seed=7, high=500), max_new_tokens=6)


def _weights(out: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n.removesuffix(".values") + ".weight" for n in out if n.endswith(".values"))


def _experts(model: torch.nn.Module) -> list[Int4StackedExperts]:
    return [m for m in model.modules() if isinstance(m, Int4StackedExperts)]


@pytest.mark.parametrize(("kind", "dtype", "group"), [
    ("awq", "float32", 128), ("awq", "bfloat16", 128), ("awq", "float32", 0),
    ("gptq", "float32", 128), ("ct", "float32", 128), ("ct", "bfloat16", 0)])
def test_zero_point_experts_are_served_as_stored(moe: Path, tmp_path: Path, kind: str, dtype: str,
                                                 group: int) -> None:
    """Every expert tensor (and every dense projection) held packed with its zero points:
    the store's dequantized values are (q - zero) * scale as the test computes them from its own
    codes; greedy tokens and log-probs equal --dequantize-checkpoint's, in fp32 and bf16 (each
    path rounds the same float32 weight once to --dtype)."""
    out = _write(kind, moe, tmp_path / "c", group)
    args = _args(tmp_path / "c", dtype)
    assert args.quantization == "int4"  # served as stored: no refusal at start
    engine = build_engine(args)[0]
    model, store = engine.runner.model, engine.runner.model.fp8_weights
    mods = _experts(model)
    assert len(mods) == 2 and all(m.w13_zero is not None and m.w13_zero.dtype == torch.int8
                                  and m.w13_zero.any() and m.w2_zero.any() for m in mods)
    for n in _weights(out):
        values, _ = store.dequantized(model.weight_view(n))
        assert torch.equal(values, meaning(out, n, group)), n
    deq = build_engine(_args(tmp_path / "c", dtype, dequantize_checkpoint=True))[0]
    assert not _experts(deq.runner.model)
    got, want = _greedy(engine), _greedy(deq)
    assert got[0] == want[0]
    assert got[1] == want[1]


def test_the_whole_model_start_holds_the_same_bytes(moe: Path, tmp_path: Path) -> None:
    """The layerwise start (each layer's experts put tensor by tensor as it loads) and the
    whole-model one (put after the build) hold the same packed bytes, scales and zero points."""
    write_awq(moe, tmp_path / "a", 128)
    args = _args(tmp_path / "a", "bfloat16")
    layerwise = build_engine(args)[0].runner.model
    whole = quantize_after_build(args, torch.bfloat16, torch.device("cpu"))
    build_engine(served_args(args), model=whole)
    a, b = dict(layerwise.named_buffers()), dict(whole.named_buffers())
    zero_names = [n for n in a if n.endswith(("w13_zero", "w2_zero"))]
    assert len(zero_names) == 4 and sorted(a) == sorted(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    for (n, p), (_, q) in zip(layerwise.named_parameters(), whole.named_parameters()):
        assert torch.equal(p, q), n


def test_an_expert_update_is_requantized_symmetric(moe: Path, tmp_path: Path) -> None:
    """Updates (per-expert names, as the trainer exports them) are quantized with the shared
    symmetric INT4 quantizer; the updated tensor's zero points become 0, the others keep the
    checkpoint's; the forward then multiplies exactly those weights (= an engine on the
    dequantized checkpoint given the same update as its INT4 values)."""
    out = write_awq(moe, tmp_path / "a", 128)
    engine = build_engine(_args(tmp_path / "a"))[0]
    model = engine.runner.model
    store = model.fp8_weights
    g = torch.Generator().manual_seed(1)
    sent = {EXPERT.format(p): torch.randn(tuple(store.hf_shape(model.weight_view(EXPERT.format(p)))),
                                          generator=g) * 0.05 for p in ("up", "down")}
    assert WeightLoader(model).from_named(sent.items()) == 2
    mod = _experts(model)[1]
    inter = mod.intermediate
    assert not mod.w13_zero[3, inter:].any() and not mod.w2_zero[3].any()
    assert mod.w13_zero[3, :inter].any() and mod.w13_zero[2].any()  # gate, other experts: kept
    for n, t in sent.items():
        assert torch.equal(store.dequantized(model.weight_view(n))[0], dequantize(quantize(t, "int4"))), n
    gate = EXPERT.format("gate")
    assert torch.equal(store.dequantized(model.weight_view(gate))[0], meaning(out, gate, 128))
    deq = build_engine(_args(tmp_path / "a", dequantize_checkpoint=True))[0]
    WeightLoader(deq.runner.model).from_named(
        (n, dequantize(quantize(t, "int4"))) for n, t in sent.items())
    assert _greedy(engine) == _greedy(deq)


def test_the_trainer_and_the_launcher(moe: Path, tmp_path: Path) -> None:
    """The trainer's loader gives the experts' meaning; a --precision int4 run's engines get
    --quantization int4 (served as stored, with zero points) and start."""
    from milepost.config import load_config
    from milepost.lowprec.rules import engine_precision_flags
    from milepost.testing.run_args import stub_run_args

    out = write_int4_asym(moe, tmp_path / "c", 128)
    model = load_model(tmp_path / "c", torch.float32, "cpu")
    for n in (EXPERT.format("gate"), EXPERT.format("down"), "model.layers.0.self_attn.o_proj.weight"):
        assert torch.equal(model.weight_view(n), meaning(out, n, 128)), n
    args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4",
                         "--n-samples-per-prompt", "2", "--device", "cpu", "--precision", "int4")
    args[args.index("--hf-checkpoint") + 1] = str(tmp_path / "c")
    assert engine_precision_flags(load_config(None, args)) == ["--quantization", "int4"]
    engine = build_engine(_args(tmp_path / "c", quantization="int4"))[0]
    assert all(m.w13_zero is not None for m in _experts(engine.runner.model))


@pytest.mark.parametrize("group", [128, 256, 0])
def test_compressed_tensors_zero_points_in_dense_linears(dense: Path, tmp_path: Path, group: int) -> None:
    """compressed-tensors `symmetric: false` (group 128, a coarser group, per channel) read into the
    dense INT4 store's `weight_zero`: values = (v - zero) * scale; greedy = --dequantize-checkpoint."""
    out = write_int4_asym(dense, tmp_path / "c", group)
    engine = build_engine(_args(tmp_path / "c"))[0]
    model, store = engine.runner.model, engine.runner.model.fp8_weights
    for n in _weights(out):
        m, _ = store._part(model.weight_view(n))
        assert m.weight_zero is not None and m.weight_zero.dtype == torch.int8
        assert torch.equal(store.dequantized(model.weight_view(n))[0], meaning(out, n, group)), n
    if group == 128:
        assert _greedy(engine) == _greedy(build_engine(_args(tmp_path / "c", dequantize_checkpoint=True))[0])


def test_zero_point_unpacking_by_definition() -> None:
    """Zero points packed down the output dim: word j of a group column holds rows 8j..8j+7, row
    8j+i in bits 4i..4i+3, stored + 8; 10 rows (a padded last word)."""
    from milepost.lowprec.checkpoint_weights import read_weight
    from milepost.lowprec.quant_checkpoint import CheckpointQuant
    from milepost.testing.quant_checkpoints import pack_int4_words

    v = torch.arange(-5, 5, dtype=torch.int8)[:, None].repeat(1, 3)  # [10, 3]
    z = torch.tensor([-8, 7, 0, 1, -1, 3, -3, 7, 5, -2], dtype=torch.int8)[:, None]
    words = torch.zeros(2, 1, dtype=torch.int64)
    for r in range(10):
        words[r // 8, 0] |= (int(z[r, 0]) + 8) << (4 * (r % 8))
    zp = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)
    ckpt = CheckpointQuant("int4_pack", "none", (), ".weight_scale", 0, zero_points=True)
    comp = {"x.weight_scale": torch.ones(10, 1), "x.weight_shape": torch.tensor([10, 3]),
            "x.weight_zero_point": zp}
    q = read_weight(ckpt, "x.weight", pack_int4_words(v), comp.get)
    assert torch.equal(dequantize(q), (v - z).float())


@pytest.mark.parametrize("case", ["fp8 asymmetric", "no zero point", "zero point shape"])
def test_what_is_still_refused_names_the_setting_or_tensor(dense: Path, tmp_path: Path, case: str) -> None:
    path = tmp_path / "c"
    write_int4_asym(dense, path, 128)
    base = "model.layers.1.mlp.down_proj"
    if case == "fp8 asymmetric":  # the FP8 stores have no zero points
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(
            {"num_bits": 8, "type": "float", "strategy": "channel", "group_size": None})
        cfg["quantization_config"]["format"] = "float-quantized"
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="symmetric is false: zero points on 8-bit 'float'"):
            ServerArgs(model_path=path, device="cpu")
        return
    t = load_file(path / "model.safetensors")
    if case == "no zero point":
        del t[base + ".weight_zero_point"]
        match = f"{base}.weight_packed has no {base}.weight_zero_point"
    else:
        t[base + ".weight_zero_point"] = t[base + ".weight_zero_point"][:1].contiguous()
        match = rf"{base}.weight_zero_point is torch.int32 \[1, 3\]; zero points of groups of 128"
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        build_engine(_args(path))
    with pytest.raises(ValueError, match=match):  # the trainer's loader alike
        load_model(path, torch.float32, "cpu")
