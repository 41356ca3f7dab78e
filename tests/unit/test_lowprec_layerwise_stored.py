"""The layerwise start (lowprec/engine_load.py) for the two start paths that built the whole model
first: quantized checkpoints served as stored (FP8 blockwise / per-tensor / per-channel, INT4
W4A16, GPTQ, AWQ) and the per-row `--quantization fp8`. Against the whole-model path
(milepost/testing/whole_start.py): the same held bytes, greedy tokens and log-probs, before and
after a weight update, with MoE experts and MLA + MTP layers; and one `--dtype` layer held at most."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.weight_fp8 import Fp8Linear
from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.contract import Contract
from milepost.lowprec.convert import convert_checkpoint
from milepost.lowprec.engine_load import held_bytes, load_quantized
from milepost.lowprec.engine_store import QuantizedLinear
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint
from milepost.testing.quant_checkpoints import write_awq, write_fp8, write_gptq, write_int4
from milepost.testing.whole_start import quantize_after_build, served_args

torch.set_num_threads(1)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def srcs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lwstored")
    # 160 / 272 wide: partial 128-wide tiles and groups.
    return {"qwen3": make_tiny_checkpoint(root / "dense", "qwen3", seed=3, with_tokenizer=False,
                                          num_hidden_layers=3, hidden_size=160, intermediate_size=272),
            "qwen3_moe": make_tiny_checkpoint(root / "moe", "qwen3_moe", seed=4, with_tokenizer=False,
                                              num_hidden_layers=3, mlp_only_layers=[1]),
            "deepseek": make_tiny_mtp_checkpoint(root / "ds", seed=1)}


def _checkpoint(src: Path, layout: str, dst: Path) -> Path:
    if layout == "bf16":
        return src
    if layout in ("fp8_block", "int4_convert"):
        fmt = layout.split("_")[0] if layout == "int4_convert" else "fp8_block"
        convert_checkpoint(src, dst, Contract(fmt, fmt, (), False))
    elif layout in ("fp8_tensor", "fp8_channel"):
        write_fp8(src, dst, layout.split("_")[1], "hf" if layout == "fp8_tensor" else "compressed-tensors")
    elif layout == "int4_pack":
        write_int4(src, dst, 128)
    elif layout == "awq":
        write_awq(src, dst, 128)
    else:
        write_gptq(src, dst, 128, sym=layout == "gptq")
    return dst


def _state(model: torch.nn.Module) -> dict[str, tuple[str, torch.dtype, torch.Tensor]]:
    """Every tensor the engine serves from, as raw bytes: parameters, buffers (an fp8 linear's row
    scales among them), and the quantized parts a linear keeps."""
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


@pytest.mark.parametrize("arch,layout,fmt", [
    ("qwen3", "fp8_block", "fp8_block"),
    ("qwen3_moe", "fp8_block", "fp8_block"),  # FP8 experts as stored
    ("deepseek", "fp8_block", "fp8_block"),  # MLA tensors dequantized, an unfused MTP layer
    ("qwen3", "fp8_tensor", "fp8_block"),
    ("qwen3", "fp8_channel", "fp8"),
    ("qwen3", "int4_pack", "int4"),
    ("qwen3_moe", "int4_pack", "int4"),  # INT4 experts as stored
    ("qwen3", "gptq", "int4"),
    ("qwen3", "gptq_asym", "int4"),  # zero points
    ("qwen3", "awq", "int4"),
    ("qwen3", "bf16", "fp8"),
    ("qwen3_moe", "bf16", "fp8"),  # experts stay in --dtype
    ("deepseek", "bf16", "fp8"),
])
def test_layerwise_start_serves_the_whole_model_paths_bytes(srcs: dict[str, Path], tmp_path: Path,
                                                            arch: str, layout: str, fmt: str) -> None:
    path = _checkpoint(srcs[arch], layout, tmp_path / "q")
    args = ServerArgs(model_path=path, device="cpu", dtype="bfloat16", max_total_tokens=256,
                      page_size=16, quantization=fmt).resolved()
    layerwise = build_engine(args)[0]
    whole = build_engine(served_args(args), model=quantize_after_build(args, torch.bfloat16, CPU))[0]
    new, old = layerwise.runner.model, whole.runner.model
    _assert_same(new, old)
    assert any(isinstance(m, Fp8Linear if fmt == "fp8" else QuantizedLinear) for m in new.modules())
    prompts = random_prompts((9, 5, 12), seed=7, high=400)
    assert greedy_outputs(layerwise, prompts, 6) == greedy_outputs(whole, prompts, 6)
    # An update re-quantizes on arrival in both: still the same bytes and outputs.
    names = set(new.hf_weight_names())  # not the MTP layer's copies of the embeddings and head
    sent = {n: (t.float() * 1.7 - 0.003).to(torch.bfloat16)
            for n, t in load_file(srcs[arch] / "model.safetensors").items() if n in names}
    k = "model.layers.1.self_attn.o_proj.weight"
    before = new.fp8_weights.dequantized(new.weight_view(k))[0]
    for m in (new, old):
        assert WeightLoader(m).from_named(sent.items()) == len(sent)
    assert not torch.equal(new.fp8_weights.dequantized(new.weight_view(k))[0], before)
    _assert_same(new, old)
    prompts = random_prompts((7, 10), seed=8, high=400)
    assert greedy_outputs(layerwise, prompts, 6) == greedy_outputs(whole, prompts, 6)


@pytest.mark.parametrize("arch,layout,fmt", [("qwen3_moe", "int4_convert", "int4"),
                                             ("qwen3_moe", "fp8_block", "fp8_block"),
                                             ("qwen3", "bf16", "fp8")])
def test_the_start_holds_one_layer_in_bf16_at_most(tmp_path: Path, arch: str, layout: str,
                                                   fmt: str) -> None:
    """The loader's per-layer hook: while a layer's `--dtype` tensors are in, the model holds no
    more than the served model plus one `--dtype` layer, below the whole `--dtype` model that
    the whole-model path holds before it stores."""
    src = make_tiny_checkpoint(tmp_path / "m", arch, seed=1, with_tokenizer=False, vocab_size=256,
                               num_hidden_layers=8, hidden_size=128, intermediate_size=512,
                               moe_intermediate_size=128)
    args = ServerArgs(model_path=_checkpoint(src, layout, tmp_path / "q"), device="cpu",
                      dtype="bfloat16", max_total_tokens=256, page_size=16, quantization=fmt).resolved()
    held: list[int] = []
    model = load_quantized(args, torch.bfloat16, CPU, observe=lambda m: held.append(held_bytes(m)))
    served = held_bytes(model)
    bf16 = load_model(args.model_path, torch.bfloat16, CPU)
    layer = max(held_bytes(x) for x in bf16.model.layers)
    assert len(held) == 8 and max(held) <= served + layer
    assert served + layer < held_bytes(bf16) * 0.8  # the bound means something here
    assert held_bytes(quantize_after_build(args, torch.bfloat16, CPU)) == served
