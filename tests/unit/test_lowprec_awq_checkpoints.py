"""Serving and training from INT4 checkpoints with zero points: AWQ (AutoAWQ's gemm layout) and
asymmetric GPTQ (`sym: false`). The packed INT4 store keeps a zero point per 128-wide group
beside each scale, so these are held as stored: every path computes (q - zero) * scale. The
checkpoints are written by hand from the layouts' definitions (milepost/testing/quant_checkpoints.py:
random codes, zeros and scales); updates re-quantize with the symmetric INT4 quantizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.kernels.int4_gemm import (
    W4Config,
    dequantize_int4,
    dequantize_int4_triton,
    int4_linear,
    w4a16_mm,
)
from milepost.lowprec.checkpoint_weights import read_weight
from milepost.lowprec.fp8_checkpoint import dequantize_state
from milepost.lowprec.quant_checkpoint import CheckpointQuant
from milepost.lowprec.quantize import QTensor, dequantize, quantize
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.quant_checkpoints import meaning, pack_awq_words, write_awq, write_gptq

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 160 and 272 input features: partial 128-wide groups, as real shapes rarely have.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("awq") / "bf16", "qwen3", seed=3,
                                with_tokenizer=False, hidden_size=160, intermediate_size=272)


def _args(path: Path, **kw: object) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=8, max_total_tokens=256, **kw).resolved()


def _greedy(engine: object) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_outputs(engine, random_prompts((9, 5), seed=7), max_new_tokens=5)


def _weights(out: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n.removesuffix(".values") + ".weight" for n in out if n.endswith(".values"))


def _write(kind: str, src: Path, dst: Path, group: int) -> dict[str, torch.Tensor]:
    if kind == "awq":
        return write_awq(src, dst, group)
    return write_gptq(src, dst, group, v1=kind == "gptq", sym=False)


def test_awq_packing_by_definition() -> None:
    """AutoAWQ's order: nibble i of a word holds element (0, 2, 4, 6, 1, 3, 5, 7)[i] of its eight,
    so elements 0..7 pack to 0x75316420; a 15 in the top nibble sets the sign bit. The reader
    gives the elements back in order (transposed: qweight is [in, out/8]), minus their zero."""
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [15, 0, 0, 0, 0, 0, 0, 15]])
    words = pack_awq_words(q)
    assert words[0, 0].item() == 0x75316420 and words[1, 0].item() < 0
    ckpt = CheckpointQuant("int4_awq", "none", (), ".scales", 0, zero_points=True)
    zeros = pack_awq_words(torch.tensor([[3, 0, 0, 0, 0, 0, 0, 9]]))
    comp = {"x.scales": torch.ones(1, 8, dtype=torch.float16), "x.qzeros": zeros}
    # qweight [in=2, out/8=1]: row r of the file is input feature r of the 8 outputs.
    got = dequantize(read_weight(ckpt, "x.weight", words, comp.get))  # [out=8, in=2]
    assert torch.equal(got, (q.t() - torch.tensor([3, 0, 0, 0, 0, 0, 0, 9])[:, None]).float())


@pytest.mark.parametrize(("kind", "group"), [("awq", 128), ("awq", 256), ("awq", 0),
                                             ("gptq", 128), ("gptq_v2", 0)])
def test_zero_point_checkpoints_are_held_as_stored(src: Path, tmp_path: Path, kind: str,
                                                   group: int) -> None:
    """AWQ and asymmetric GPTQ (v1 stores zero - 1, v2 the zero): groups of 128, coarser ones
    (each 128-wide group takes its group's scale and zero) and per channel. The store's
    dequantized weights are (q - zero) * scale as the test computes it from its own codes; greedy
    tokens and log-probs equal an engine started with --dequantize-checkpoint."""
    out = _write(kind, src, tmp_path / "c", group)
    args = _args(tmp_path / "c")
    assert args.quantization == "int4"
    engine = build_engine(args)[0]
    model, store = engine.runner.model, engine.runner.model.fp8_weights
    for n in _weights(out):
        m, _ = store._part(model.weight_view(n))
        assert m.weight.dtype == torch.uint8 and m.weight_zero.dtype == torch.int8
        values, _ = store.dequantized(model.weight_view(n))
        assert torch.equal(values, meaning(out, n, group)), n
    if group == 128 or kind == "gptq_v2":  # the decode comparison once per reader
        deq = build_engine(_args(tmp_path / "c", dequantize_checkpoint=True))[0]
        assert _greedy(engine) == _greedy(deq)


def test_the_trainers_load_what_the_checkpoint_means(src: Path, tmp_path: Path) -> None:
    """FSDP's loader (registry.load_native) and the Megatron reader (dequantize_state) alike."""
    out = write_awq(src, tmp_path / "a", 128)
    model = load_model(tmp_path / "a", torch.float32, "cpu")
    state = dequantize_state(tmp_path / "a", load_file(tmp_path / "a" / "model.safetensors"))
    for n in _weights(out):
        assert torch.equal(model.weight_view(n), meaning(out, n, 128)), n
        assert torch.equal(state[n], meaning(out, n, 128)), n


def test_an_update_is_requantized_symmetric(src: Path, tmp_path: Path) -> None:
    """The sender sends the weights' values (bf16 here); the engine quantizes them with the
    shared symmetric INT4 quantizer and sets the part's zero points to 0, so the store holds
    what an engine quantizing on load holds (and --check-weight-update-equal's bound is the
    symmetric format's). The other parts of the fused linear keep the checkpoint's zeros."""
    out = write_awq(src, tmp_path / "a", 128)
    model = build_engine(_args(tmp_path / "a"))[0].runner.model
    store = model.fp8_weights
    q_name, k_name = (f"model.layers.0.self_attn.{p}_proj.weight" for p in ("q", "k"))
    sent = torch.randn(tuple(store.hf_shape(model.weight_view(q_name))),
                       generator=torch.Generator().manual_seed(1)).bfloat16()
    store.write(model.weight_view(q_name), sent)
    values, scale = store.dequantized(model.weight_view(q_name))
    want = quantize(sent.float(), "int4")
    assert torch.equal(values, dequantize(want)) and torch.equal(scale[:, ::128], want.scales)
    m, j = store._part(model.weight_view(q_name))
    row, rows, _ = m.qparts[j]
    assert not m.weight_zero[row:row + rows].any()
    assert torch.equal(store.dequantized(model.weight_view(k_name))[0], meaning(out, k_name, 128))
    # The forward multiplies exactly those weights, the parts of the fused qkv together.
    x = torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(2))
    w = torch.cat([dequantize(q) for _, _, q in m.qparts])
    assert torch.equal(m(x), F.linear(x, w))


@pytest.mark.parametrize("cfg", [None, W4Config(16, 64, 2)], ids=["rule", "split"])
def test_every_int4_path_subtracts_the_zero_before_scaling(cfg: W4Config | None) -> None:
    """(v - zero) * scale in float32, as quantize.dequantize computes it: torch's path (CPU,
    prefill; int4_linear's exact F.linear bits), the Triton dequantization (its bits; Triton's
    interpreter here, fp32 and fp16) and the W4A16 kernel (fp32 sums of those weights). Zero
    points and scales differ per row and group (N, K not multiples of the blocks), so one read
    from the wrong place shows; the GPU's bf16 is tests/gpu's."""
    g = torch.Generator().manual_seed(0)
    n, k = 70, 300
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 2, k)[None, :]
    q = quantize(w, "int4")
    zeros = torch.randint(-8, 9, tuple(q.scales.shape), generator=g, dtype=torch.int8)
    ref = dequantize(QTensor("int4", q.values, q.scales, q.tile, q.shape, zeros=zeros))
    assert not torch.equal(ref, dequantize(q))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_int4(q.values, q.scales, k, dtype, zeros), ref.to(dtype))
    for dtype in (torch.float32, torch.float16):
        got = dequantize_int4_triton(q.values, q.scales, k, dtype, zeros)
        assert torch.equal(got, ref.to(dtype)), dtype
    x = torch.randn(5, k, generator=g)
    assert torch.equal(int4_linear(x, q.values, q.scales, k, None, zeros), F.linear(x, ref))
    want = x @ ref.t()
    y = w4a16_mm(x, q.values, q.scales, k, cfg, zeros)
    assert ((y - want).abs() <= 1e-5 * want.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize(("edit", "match"), [
    ({"bits": 8}, "bits is 8"),
    ({"version": "gemv"}, "version is 'gemv'"),
    ({"version": "marlin"}, "version is 'marlin'"),
    ({"version": "exllama"}, "version is 'exllama'"),
    ({"backend": "llm-awq"}, "backend is 'llm-awq'"),
    ({"zero_point": False}, "zero_point is false"),
    ({"desc_act": True}, "desc_act is set"),
    ({"group_size": 0}, "group_size is 0"),
])
def test_awq_settings_the_store_cannot_hold_are_refused(src: Path, tmp_path: Path, edit: dict,
                                                        match: str) -> None:
    write_awq(src, tmp_path / "a", 128)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["quantization_config"].update(edit)
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        ServerArgs(model_path=tmp_path / "a", device="cpu").resolved()


def test_awq_finer_groups_are_refused_as_stored_and_dequantized_on_request(src: Path,
                                                                         tmp_path: Path) -> None:
    out = write_awq(src, tmp_path / "g32", 32)
    with pytest.raises(ValueError, match="INT4 group_size 32; the engines' INT4 store has one"):
        ServerArgs(model_path=tmp_path / "g32", device="cpu").resolved()
    model = build_engine(_args(tmp_path / "g32", dequantize_checkpoint=True))[0].runner.model
    for n in _weights(out):
        assert torch.equal(model.weight_view(n), meaning(out, n, 32)), n


@pytest.mark.parametrize("case", ["no qzeros", "scales shape", "qweight dtype"])
def test_bad_awq_tensors_are_refused_naming_them(src: Path, tmp_path: Path, case: str) -> None:
    path = tmp_path / "a"
    write_awq(src, path, 128)
    t = load_file(path / "model.safetensors")
    base = "model.layers.1.mlp.down_proj"
    if case == "no qzeros":
        del t[base + ".qzeros"]
        match = f"{base}.qweight has no {base}.qzeros"
    elif case == "scales shape":
        t[base + ".scales"] = t[base + ".scales"][:1].contiguous()
        match = rf"{base}.scales has shape \[1, 160\]; groups of 128"
    else:
        t[base + ".qweight"] = t[base + ".qweight"].to(torch.int64)
        match = f"{base}.qweight is torch.int64"
    save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=match):
        build_engine(_args(path))
    with pytest.raises(ValueError, match=match):  # the trainer's loader alike
        load_model(path, torch.float32, "cpu")


def test_the_launcher_and_the_disk_update(src: Path, tmp_path: Path) -> None:
    """A bf16 rollout dequantizes (--dequantize-checkpoint); an int4 one serves the checkpoint
    as stored; a disk update of such a checkpoint is refused naming the layout."""
    from milepost.config import load_config
    from milepost.engine.weight_update import WeightLoader, WeightUpdateError
    from milepost.lowprec.rules import engine_precision_flags
    from milepost.testing.run_args import stub_run_args

    write_awq(src, tmp_path / "a", 128)

    def cfg(*flags: str) -> object:
        args = stub_run_args(tmp_path, "--num-rollout", "2", "--rollout-batch-size", "4",
                             "--n-samples-per-prompt", "2", "--device", "cpu", *flags)
        args[args.index("--hf-checkpoint") + 1] = str(tmp_path / "a")
        return load_config(None, args)

    assert engine_precision_flags(cfg()) == ["--dequantize-checkpoint"]
    assert engine_precision_flags(cfg("--precision", "int4")) == ["--quantization", "int4"]
    plain = build_engine(_args(src))[0].runner.model
    with pytest.raises(WeightUpdateError, match="a int4_awq checkpoint; /update_weights_from_disk"):
        WeightLoader(plain).from_disk(str(tmp_path / "a"))
