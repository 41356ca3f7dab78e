"""Per-channel FP8 MoE experts (lowprec/experts_fp8_row.py): a compressed-tensors "FP8-dynamic"
checkpoint of a tiny Qwen3-MoE (written by hand from the layout, milepost/testing/quant_checkpoints.py)
served as stored by the row-scaled fp8 store, its experts included: the stored bytes and scales,
greedy tokens, log-probs and routed experts equal to `--dequantize-checkpoint`, updates
re-quantized per row (per-expert and stacked names) within the row bound, and what the store
cannot hold refused naming the tensor. The fused FP8 MoE kernels read row scales as [N, 1] block
scales: checked under Triton's interpreter in fp32 (bf16 on the GPU:
tests/gpu/test_fused_moe_fp8_row_cuda.py).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
f8 = importlib.import_module("milepost.kernels.fused_moe_fp8")

from milepost.engine.request import Request
from milepost.engine.sampling_params import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.experts_fp8_row import Fp8RowStackedExperts
from milepost.models.qwen3_moe import StackedExperts
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.quant_checkpoints import fp8_codes, meaning, write_fp8
from milepost.weights.fp8 import dequantize_rows, fp8_error_bound, quantize_rows

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DOWN = "model.layers.1.mlp.experts.6.down_proj.weight"


def _row_experts(experts: int, hidden: int, inter: int, seed: int) -> Fp8RowStackedExperts:
    """Row-scaled experts with random codes and scales spread over four orders of magnitude per
    row (gate's rows apart from up's), so a scale read from another row or expert shows."""
    from milepost.lowprec.experts_fp8_row import _convert_rows

    g = torch.Generator().manual_seed(seed)
    mod = StackedExperts(experts, hidden, inter)
    _convert_rows(mod)
    with torch.no_grad():
        mod.w13.copy_(fp8_codes(tuple(mod.w13.shape), g))
        mod.w2.copy_(fp8_codes(tuple(mod.w2.shape), g))
        mod.w13_scale.copy_(10 ** (torch.rand(mod.w13_scale.shape, generator=g) * 4 - 6))
        mod.w13_scale[:, 1] *= 30.0
        mod.w2_scale.copy_(10 ** (torch.rand(mod.w2_scale.shape, generator=g) * 4 - 5))
    return mod.to(DEV)  # type: ignore[return-value]


@pytest.mark.parametrize("block_n,block_k,swap", [(32, 64, False), (64, 128, True), (16, 256, False)])
def test_row_scaled_kernels_equal_dequantize_then_matmul(block_n: int, block_k: int, swap: bool) -> None:
    """hidden 160 and intermediate 48: K steps that end in a partial block; BLOCK_K 256 spans
    the whole K (row scales have no 128-wide K block to stay in)."""
    from milepost.testing.moe_reference import expert_loop

    experts, hidden, inter, k, t = 5, 160, 48, 2, 6
    mod = _row_experts(experts, hidden, inter, seed=0)
    assert tuple(mod.w13_scale.shape) == (experts, 2, inter, 1)
    assert tuple(mod.w2_scale.shape) == (experts, hidden, 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, hidden, generator=g).to(DEV)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]).to(DEV)
    w = torch.rand(t, k, generator=g).to(DEV)
    ref = expert_loop(x, ids, w, mod.dequantize_w13(), mod.dequantize_w2())
    cfg = f8.MoeConfig(16, f8.GemmConfig(block_n, block_k, swap_ab=swap),
                       f8.GemmConfig(block_n, block_k, swap_ab=swap), hist_align=swap)
    args = (mod.w13, mod.w13_scale, mod.w2, mod.w2_scale, cfg)
    got = f8.fused_expert_mlp_fp8(x, ids, w, *args, row_scales=True)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert torch.equal(got, f8.fused_expert_mlp_fp8(x, ids, w, *args, row_scales=True))
    # Read as 128 x 128 block scales the same tensors give another product: the flag matters.
    if block_k <= 128:
        block = f8.fused_expert_mlp_fp8(x, ids, w, *args)
        assert not torch.allclose(block, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    with pytest.raises(ValueError, match="W8A8 kernels read 128 x 128 block scales only"):
        f8.fused_expert_mlp_fp8(x, ids, w, *args, act_fp8=True, row_scales=True)
    if DEV == "cpu":  # off CUDA the module runs the loop on the dequantized weights
        with torch.no_grad():
            torch.testing.assert_close(mod(x, ids, w), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8row")
    return (make_tiny_checkpoint(root / "bf16", "qwen3_moe", seed=5, with_tokenizer=False),
            make_tiny_checkpoint(root / "b", "qwen3_moe", seed=6, with_tokenizer=False))


def _args(path: Path, **kw: object) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", page_size=4, chunked_prefill_size=8,
                      max_total_tokens=256, **kw).resolved()


def _routed(engine: object, prompt: list[int]) -> str:
    got: list[str] = []
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    engine.submit(Request(  # type: ignore[attr-defined]
        rid="r", prompt_ids=prompt, stop_ids=frozenset(), return_routed_experts=True, params=params,
        on_output=lambda o: got.append(o.routed_experts) if o.routed_experts else None))
    engine._drain_inbox(block=False)  # type: ignore[attr-defined]
    while engine.scheduler.has_work:  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
    engine._flush()  # type: ignore[attr-defined]
    return got[-1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_as_stored_equals_the_dequantized_checkpoint(moe: tuple[Path, Path], tmp_path: Path,
                                                            dtype: str) -> None:
    out = write_fp8(moe[0], tmp_path / "ch", "channel")
    # W8A16 (the dequantized checkpoint's forward); the dense W8A8 default: test_lowprec_fp8_dynamic.py
    args = _args(tmp_path / "ch", dtype=dtype, fp8_weight_only=True)
    assert args.quantization == "fp8"  # the row-scaled store, experts included
    engine = build_engine(args)[0]
    model = engine.runner.model
    assert all(type(layer.mlp.experts) is Fp8RowStackedExperts for layer in model.model.layers)
    experts = sorted(n for n in out if ".experts." in n and n.endswith("_proj.weight"))
    assert len(experts) == 2 * 8 * 3
    for n in experts:  # every code and scale as the file has them
        view = model.weight_view(n)
        assert view.dtype == torch.float8_e4m3fn
        assert torch.equal(view.view(torch.uint8), out[n].view(torch.uint8)), n
        values, scale = model.fp8_weights.dequantized(view)
        assert torch.equal(scale, out[n.removesuffix("weight") + "weight_scale"].float().reshape(-1)), n
        assert torch.equal(values, meaning(out, n)), n
    assert model.weight_view("model.layers.0.mlp.gate.weight").dtype == args.torch_dtype()  # router
    deq = build_engine(_args(tmp_path / "ch", dtype=dtype, dequantize_checkpoint=True))[0]
    assert type(deq.runner.model.model.layers[0].mlp.experts) is StackedExperts
    prompts = random_prompts((9, 5), seed=7)
    assert greedy_outputs(engine, prompts, 5) == greedy_outputs(deq, prompts, 5)  # tokens, log-probs
    assert _routed(engine, prompts[0]) == _routed(deq, prompts[0])


def test_updates_requantize_per_row_under_every_name(moe: tuple[Path, Path], tmp_path: Path) -> None:
    """Per-expert names and transformers 5's stacked gate_up_proj / down_proj: each HF tensor
    re-quantized per row on arrival (the row store's quantizer, bit for bit), its values within
    the row bound the trainer's check admits; a value off that bound is caught."""
    write_fp8(moe[0], tmp_path / "ch", "channel")
    model = build_engine(_args(tmp_path / "ch", dtype="float32"))[0].runner.model
    store = model.fp8_weights
    sent = {n: t.float() * 1.5 for n, t in load_file(moe[1] / "model.safetensors").items()}
    assert WeightLoader(model).from_named(sent.items(), strict_dtype=True) == len(sent)
    for n in (DOWN, "model.layers.0.mlp.experts.2.gate_proj.weight",
              "model.layers.0.mlp.experts.7.up_proj.weight"):
        view = model.weight_view(n)
        values, scale = store.dequantized(view)
        want_v, want_s = quantize_rows(sent[n])
        assert torch.equal(view.view(torch.uint8), want_v.view(torch.uint8)) and torch.equal(scale, want_s), n
        assert ((values - sent[n]).abs() <= fp8_error_bound(sent[n], scale)).all(), n
    inter = model.hf_config.moe_intermediate_size
    fused = model.weight_view("model.layers.1.mlp.experts.gate_up_proj")
    assert store.owner(fused) is not None
    values, scale = store.dequantized(fused)
    assert scale.shape == fused.shape[:-1]
    up3 = sent["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(values[3, inter:], dequantize_rows(*quantize_rows(up3)))
    stacked = values.flip(0) * 2.0  # every expert's gate and up rows from one tensor
    WeightLoader(model).from_named([("model.layers.1.mlp.experts.gate_up_proj", stacked)])
    got, scale = store.dequantized(fused)
    assert ((got - stacked).abs() <= fp8_error_bound(stacked, scale)).all()
    assert not ((got * 1.2 - stacked).abs() <= fp8_error_bound(stacked, scale)).all()
    gate = store.dequantized(model.weight_view("model.layers.1.mlp.experts.0.gate_proj.weight"))[0]
    assert torch.equal(gate, dequantize_rows(*quantize_rows(stacked[0, :inter])))


def test_bf16_checkpoint_under_fp8_keeps_experts_unquantized(moe: tuple[Path, Path]) -> None:
    """`--quantization fp8` on an unquantized checkpoint quantizes the projections only, as before:
    only a checkpoint's own FP8 experts are held in FP8."""
    model = build_engine(_args(moe[0], dtype="float32", quantization="fp8"))[0].runner.model
    assert type(model.model.layers[0].mlp.experts) is StackedExperts
    assert model.fp8_weights.owner(model.weight_view(DOWN)) is None


def test_what_the_store_cannot_hold_is_refused_naming_the_tensor(moe: tuple[Path, Path],
                                                                 tmp_path: Path) -> None:
    # Some experts of a layer in FP8 and some in bf16: one stacked store per layer.
    write_fp8(moe[0], tmp_path / "mix", "channel", keep=("model.layers.0.mlp.experts.3",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.3\.gate_proj\.weight: stored "
                                         r"unquantized by the checkpoint while other experts"):
        build_engine(_args(tmp_path / "mix"))
    # A whole layer's experts left in bf16 is held as stored (bf16), the other layer's in FP8.
    write_fp8(moe[0], tmp_path / "keep", "channel", keep=("model.layers.0.mlp.experts",))
    model = build_engine(_args(tmp_path / "keep"))[0].runner.model
    assert type(model.model.layers[0].mlp.experts) is StackedExperts
    assert type(model.model.layers[1].mlp.experts) is Fp8RowStackedExperts
    # A quantized router and a stacked (3-d) float8 expert tensor: no store holds them.
    out = write_fp8(moe[0], tmp_path / "ch", "channel")
    for case in ("router", "stacked"):
        t = dict(out)
        if case == "router":
            name = "model.layers.1.mlp.gate.weight"
            t[name] = fp8_codes(tuple(out[name].shape), torch.Generator().manual_seed(0))
            t["model.layers.1.mlp.gate.weight_scale"] = torch.ones(out[name].shape[0], 1)
        else:
            name = "model.layers.1.mlp.experts.gate_up_proj"
            prefix = "model.layers.1.mlp.experts"
            stack = [torch.cat([t.pop(f"{prefix}.{e}.{p}_proj.weight").view(torch.uint8)
                                for p in ("gate", "up")]) for e in range(8)]
            for e in range(8):
                for p in ("gate", "up"):
                    t.pop(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight_scale")
            t[name] = torch.stack(stack).view(torch.float8_e4m3fn)
        save_file(t, tmp_path / "ch" / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"{name}: a fp8_channel weight that the fp8 store does not hold"):
            ServerArgs(model_path=tmp_path / "ch", device="cpu").resolved()
    # A misshapen expert scale, at load.
    t = dict(out)
    bad = "model.layers.0.mlp.experts.4.down_proj.weight_scale"
    t[bad] = t[bad][:-1]
    save_file(t, tmp_path / "ch" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{bad} has shape .*per-channel scales"):
        build_engine(_args(tmp_path / "ch"))
