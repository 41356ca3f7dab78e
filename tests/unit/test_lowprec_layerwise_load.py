"""A quantized engine start from an unquantized checkpoint loads, fuses and quantizes layer by
layer (lowprec/engine_load.py): the served weights equal quantize-after-build bit for bit, updates
re-quantize as before, and the model never holds more than one layer in the model dtype."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.engine_load import held_bytes, load_quantized
from milepost.lowprec.engine_setup import store_engine_precision
from milepost.lowprec.engine_store import QuantizedLinear
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint
from milepost.testing.random_checkpoint import write_random_checkpoint

torch.set_num_threads(1)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layerwise")
    return {"qwen3": make_tiny_checkpoint(root / "dense", "qwen3", seed=5, with_tokenizer=False,
                                          num_hidden_layers=3),
            "qwen3_moe": make_tiny_checkpoint(root / "moe", "qwen3_moe", seed=6, with_tokenizer=False,
                                              num_hidden_layers=3, mlp_only_layers=[1])}


def _args(path: Path, fmt: str, **kw: object) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", dtype="bfloat16", quantization=fmt,
                      max_total_tokens=256, page_size=16, **kw).resolved()


def _after_build(args: ServerArgs):
    """Today's other path (an FP8 checkpoint, a model handed in): the whole model in bf16, then
    fused, then quantized."""
    model = load_model(args.model_path, torch.bfloat16, CPU)
    model.fuse_projections()
    store_engine_precision(model, args, CPU)
    return model


def _state(model: torch.nn.Module) -> dict[str, tuple[str, torch.dtype, torch.Tensor]]:
    """Every tensor the engine serves from, as raw bytes: parameters, buffers, and the quantized
    parts a linear keeps (an emulated one beside its dequantized weight)."""
    out = {n: (type(model.get_submodule(n.rsplit(".", 1)[0])).__name__, t.dtype, t.detach())
           for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            for j, (row, rows, q) in enumerate(m.qparts):
                out[f"{name}.part{j}.values"] = (f"{row}+{rows}", q.values.dtype, q.values)
                out[f"{name}.part{j}.scales"] = (q.fmt, q.scales.dtype, q.scales)
    return {n: (c, d, t.contiguous().view(torch.uint8)) for n, (c, d, t) in out.items()}


def _assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = _state(a), _state(b)
    assert sorted(sa) == sorted(sb)
    for n in sa:
        assert sa[n][:2] == sb[n][:2], n
        assert torch.equal(sa[n][2], sb[n][2]), n


@pytest.mark.parametrize("arch,fmt,kw", [
    ("qwen3", "fp8_block", {}),
    ("qwen3", "int4", {}),
    ("qwen3", "nvfp4", {"nvfp4_four_over_six": True}),
    ("qwen3", "mxfp8", {"precision_override": "layers.1-1=bf16"}),
    ("qwen3_moe", "fp8_block", {"precision_override": "layers.2-2=bf16"}),
    ("qwen3_moe", "int4", {"precision_override": "layers.2-2=bf16"}),
])
def test_layerwise_start_serves_the_bits_of_quantize_after_build(ckpts: dict[str, Path], arch: str,
                                                                 fmt: str, kw: dict) -> None:
    args = _args(ckpts[arch], fmt, **kw)
    seen: list[int] = []
    model = load_quantized(args, torch.bfloat16, CPU, observe=lambda m: seen.append(len(seen)))
    assert seen == [0, 1, 2]  # the hook ran once per decoder layer
    old = _after_build(args)
    _assert_same(model, old)
    assert any(isinstance(m, QuantizedLinear) for m in model.modules())
    # Updates re-quantize on arrival, as after a whole load: still the same bits.
    k = "model.layers.0.self_attn.k_proj.weight"
    before = model.fp8_weights.dequantized(model.weight_view(k))[0]
    sent = {n: (t * 1.7 - 0.003).to(torch.bfloat16)
            for n, t in load_file(ckpts[arch] / "model.safetensors").items()}
    for m in (model, old):
        assert WeightLoader(m).from_named(sent.items()) == len(sent)
    assert not torch.equal(model.fp8_weights.dequantized(model.weight_view(k))[0], before)
    _assert_same(model, old)


@pytest.mark.parametrize("fmt", ["fp8_block", "int4"])
def test_deepseek_with_an_mtp_layer(tmp_path: Path, fmt: str) -> None:
    """MLA layers, dense then MoE layers, and the MTP layer (checkpoint layer N, loaded last,
    not fused): the same bits as quantize-after-build."""
    args = _args(make_tiny_mtp_checkpoint(tmp_path / "ds", seed=1), fmt)
    seen: list[int] = []
    model = load_quantized(args, torch.bfloat16, CPU, observe=lambda m: seen.append(1))
    assert model.num_mtp_layers == 1 and len(seen) == model.num_layers + 1
    _assert_same(model, _after_build(args))


def test_engine_start_takes_the_layerwise_path(ckpts: dict[str, Path], caplog) -> None:
    with caplog.at_level(logging.INFO, logger="milepost.lowprec.engine_load"):
        engine, _, _ = build_engine(_args(ckpts["qwen3_moe"], "fp8_block"))
    assert any("layer by layer" in r.getMessage() for r in caplog.records)
    _assert_same(engine.runner.model, _after_build(_args(ckpts["qwen3_moe"], "fp8_block")))


@pytest.mark.parametrize("arch,fmt", [("qwen3", "int4"), ("qwen3_moe", "fp8_block")])
def test_the_start_holds_one_layer_in_bf16_at_most(tmp_path: Path, arch: str, fmt: str) -> None:
    """Counted by the loader's own per-layer hook: the bytes the model holds when a layer's bf16
    tensors are in (before it is quantized) never pass the served model plus one bf16 layer, and
    that bound is below the bf16 model the quantize-after-build path holds."""
    path = make_tiny_checkpoint(tmp_path / "m", arch, seed=1, with_tokenizer=False, vocab_size=256,
                                num_hidden_layers=8, hidden_size=128, intermediate_size=512,
                                moe_intermediate_size=128)
    args = _args(path, fmt)
    held: list[int] = []
    model = load_quantized(args, torch.bfloat16, CPU, observe=lambda m: held.append(held_bytes(m)))
    served = held_bytes(model)
    whole = load_model(path, torch.bfloat16, CPU)  # what the other path holds before quantizing
    bf16, layer = held_bytes(whole), max(held_bytes(x) for x in whole.model.layers)
    assert len(held) == 8 and max(held) <= served + layer
    assert served + layer < bf16 * 0.75  # the bound means something for this model
    assert held_bytes(_after_build(args)) == served


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_each_shard_is_unmapped_once_its_layers_are_read(tmp_path: Path) -> None:
    """One shard per layer: when layer i is in (and about to be quantized), the shards of the
    embeddings and of layers <= i are no longer mapped (their pages leave the resident set)."""
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      vocab_size=256, tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    path = write_random_checkpoint(tmp_path / "m", config)

    def mapped(_: object) -> None:
        maps = Path("/proc/self/maps").read_text().splitlines()
        seen.append(sorted({Path(line.split()[-1]).name for line in maps if str(path) in line}))

    seen: list[list[str]] = []
    load_quantized(_args(path, "int4"), torch.bfloat16, CPU, observe=mapped)
    assert seen == [[f"model-{k:05d}.safetensors" for k in range(i + 2, 5)] for i in range(4)]


def test_expert_chunks_bounded_by_bytes_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts are quantized a byte budget at a time (the temporaries beside a layerwise start):
    chunks of 2 of 5 experts give the bits of one call for all (tiles are each tensor's own)."""
    from milepost.lowprec import engine_experts
    from milepost.models.qwen3_moe import StackedExperts

    g = torch.Generator().manual_seed(4)
    weights = (torch.randn(5, 256, 256, generator=g) * torch.logspace(-2, 1, 5)[:, None, None],
               torch.randn(5, 256, 128, generator=g))
    held = []
    for budget in (2**30, 2 * 256 * 256 * 4):  # everything at once; 2 experts of w13 per call
        monkeypatch.setattr(engine_experts, "_CHUNK_BYTES", budget)
        mod = StackedExperts(5, 256, 128)
        with torch.no_grad():
            mod.w13.copy_(weights[0])
            mod.w2.copy_(weights[1])
        engine_experts._convert(mod)
        held.append([t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                     for t in (mod.w13, mod.w2, mod.w13_scale, mod.w2_scale)])
    assert all(torch.equal(a, b) for a, b in zip(*held))
