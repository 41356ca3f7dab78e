"""INT4 MoE experts under `--precision int4` (lowprec/experts_int4.py): the engine packs each
expert's gate/up (fused) and down two nibbles a byte with float32 group scales, and its served
weights dequantize bit for bit to the trainer's fake-quant expert weights; updates re-pack on
arrival under per-expert and fused names; greedy decoding (tokens, log-probs, routed experts)
equals an fp32 engine holding the dequantized weights; the trainer's gradient passes straight
through. Tiny Qwen3-MoE with hidden 200 and expert intermediate 160: a partial 128-wide group
on both sides and an even packed width."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.engine.request import Request
from milepost.engine.sampling_params import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.weight_update import WeightLoader, WeightUpdateError
from milepost.lowprec.contract import Contract, parse_overrides
from milepost.lowprec.engine_store import store_quantized
from milepost.lowprec.experts_int4 import Int4QatExperts, Int4StackedExperts
from milepost.lowprec.linear import apply_train_precision, qdq
from milepost.lowprec.quantize import dequantize, error_bound, quantize
from milepost.models.qwen3_moe import StackedExperts
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint

torch.set_num_threads(1)
INT4 = Contract("int4", "int4")
E, H, I = 8, 200, 160  # experts, hidden, expert intermediate


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("i4moe") / "m", "qwen3_moe", seed=4,
                                with_tokenizer=False, hidden_size=H, moe_intermediate_size=I,
                                head_dim=40)


def _expert_names(layer: int) -> list[str]:
    return [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight" for e in range(E)
            for p in ("gate", "up", "down")]


def test_contract_trains_and_serves_experts_in_int4() -> None:
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert INT4.tensor_format(name, "train") == INT4.tensor_format(name, "rollout") == "int4"
    assert Contract("bf16", "int4").tensor_format(name, "train") == "bf16"  # QAT needs the trainer
    keep = Contract("int4", "int4", parse_overrides(["*.experts.*=bf16"]))
    assert keep.tensor_format(name, "train") == keep.tensor_format(name, "rollout") == "bf16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_served_experts_are_packed_and_dequantize_to_the_trainers_weights(ckpt: Path,
                                                                          dtype: torch.dtype) -> None:
    model = load_model(ckpt, dtype, "cpu")
    model.fuse_projections()
    store = store_quantized(model, INT4)
    trainer = load_model(ckpt, dtype, "cpu")
    names = apply_train_precision(trainer, INT4)
    assert set(_expert_names(0)) <= set(names)
    for layer in (0, 1):
        served = model.model.layers[layer].mlp.experts
        assert isinstance(served, Int4StackedExperts)
        assert served.w13.dtype == torch.uint8 and served.w13.shape == (E, 2 * I, H // 2)
        assert served.w13_scale.shape == (E, 2 * I, 2) and served.w2.shape == (E, H, I // 2)
        assert served.w2_scale.shape == (E, H, 2)  # K = 160: groups 128 and 32
        qat = trainer.model.layers[layer].mlp.experts
        assert isinstance(qat, Int4QatExperts)
        # The contract, bit for bit: what the engine multiplies is the trainer's forward weight.
        for mine, theirs in zip(served.expert_weights(), qat.expert_weights()):
            assert mine.dtype == dtype and torch.equal(mine, theirs)
    sd = load_file(ckpt / "model.safetensors")
    for hf in ("model.layers.0.mlp.experts.5.gate_proj.weight",
               "model.layers.1.mlp.experts.2.up_proj.weight",
               "model.layers.1.mlp.experts.7.down_proj.weight"):
        view = model.weight_view(hf)
        assert store.owner(view) is not None and store.format_of(view) == "int4"
        assert store.hf_shape(view) == tuple(sd[hf].shape) and view.shape[-1] * 2 == sd[hf].shape[-1]
        q = quantize(sd[hf].to(dtype), "int4")
        assert torch.equal(view, q.values)  # its own groups' packed bytes
        assert torch.equal(store.dequantized(view)[0], dequantize(q))


def test_updates_repack_under_per_expert_and_fused_names(ckpt: Path) -> None:
    model = load_model(ckpt, torch.float32, "cpu")
    model.fuse_projections()
    store = store_quantized(model, INT4)
    sent = {n: t * 1.5 - 0.01 for n, t in load_file(ckpt / "model.safetensors").items()}
    assert WeightLoader(model).from_named(sent.items(), strict_dtype=True) == len(sent)
    for hf in _expert_names(1)[::5]:
        view = model.weight_view(hf)
        values, scale = store.dequantized(view)
        assert torch.equal(view, quantize(sent[hf], "int4").values), hf  # re-packed on arrival
        assert ((values - sent[hf]).abs() <= error_bound("int4", sent[hf], scale)).all()
    # transformers 5's fused names address every expert of a layer: [E, 2I, H] and [E, H, I]
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    view = model.weight_view(fused)
    assert store.hf_shape(view) == (E, 2 * I, H)
    new = torch.randn(E, 2 * I, H, generator=torch.Generator().manual_seed(1))
    assert WeightLoader(model).from_named([(fused, new)]) == 1
    up3 = model.weight_view("model.layers.0.mlp.experts.3.up_proj.weight")
    assert torch.equal(store.dequantized(up3)[0], dequantize(quantize(new[3, I:], "int4")))
    assert torch.equal(store.dequantized(view)[0][3, I:], store.dequantized(up3)[0])
    down = "model.layers.1.mlp.experts.0.down_proj.weight"
    with pytest.raises(WeightUpdateError, match=rf"{down}: shape mismatch, model expects \[{H}, {I}\], "
                                                rf"got \[{H}, {I // 2}\]"):
        WeightLoader(model).from_named([(down, torch.zeros(H, I // 2))])


def test_trainer_gradient_passes_straight_through(ckpt: Path) -> None:
    trainer = load_model(ckpt, torch.float32, "cpu")
    apply_train_precision(trainer, INT4)
    experts = trainer.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, H, generator=g)
    ids = torch.randint(0, E, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    experts(x, ids, w).square().sum().backward()
    # The same computation on plain experts holding the fake-quant values: the same gradients
    # (straight through: d/dw of the quantized weight is taken as 1).
    plain = load_model(ckpt, torch.float32, "cpu").model.layers[0].mlp.experts
    with torch.no_grad():
        plain.w13.copy_(qdq(experts.w13, "int4", "weight"))
        plain.w2.copy_(qdq(experts.w2, "int4", "weight"))
    plain(x, ids, w).square().sum().backward()
    assert experts.w13.grad is not None and experts.w13.grad.abs().sum() > 0
    assert torch.equal(experts.w13.grad, plain.w13.grad) and torch.equal(experts.w2.grad, plain.w2.grad)


def _greedy(args: ServerArgs) -> list[tuple[list[int], list[float], str]]:
    engine = build_engine(args)[0]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 4)]
    got: dict[int, tuple[list[int], list[float], list[str]]] = {i: ([], [], []) for i in range(2)}

    def out(o: object, i: int) -> None:
        got[i][0].extend(o.new_token_ids)
        got[i][1].extend(o.new_logprobs)
        if o.routed_experts is not None:
            got[i][2].append(o.routed_experts)

    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(), return_logprob=True,
                              return_routed_experts=True,
                              params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                              on_output=lambda o, i=i: out(o, i)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    return [(t, lp, r[-1]) for t, lp, r in got.values()]


def test_greedy_equals_an_fp32_engine_holding_the_dequantized_weights(ckpt: Path, tmp_path: Path) -> None:
    """Dense projections and experts in INT4; the reference engine serves a float32 checkpoint of
    the quantizer's dequantized values, unquantized. Tokens, log-probs and routed experts equal."""
    kw = dict(device="cpu", dtype="float32", page_size=4, chunked_prefill_size=8, max_total_tokens=256)
    got = _greedy(ServerArgs(model_path=ckpt, quantization="int4", **kw).resolved())
    sd = load_file(ckpt / "model.safetensors")
    covered = {n for n in sd if INT4.tensor_format(n, "rollout") == "int4"}
    assert len(covered) == 2 * (4 + 3 * E)
    ref_dir = tmp_path / "deq"
    ref_dir.mkdir()
    save_file({n: dequantize(quantize(t, "int4")) if n in covered else t for n, t in sd.items()},
              ref_dir / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(ckpt / "config.json", ref_dir / "config.json")
    want = _greedy(ServerArgs(model_path=ref_dir, **kw).resolved())
    plain = _greedy(ServerArgs(model_path=ckpt, **kw).resolved())
    assert all(r for _, _, r in got)  # routed experts recorded
    assert got == want
    assert [lp for _, lp, _ in got] != [lp for _, lp, _ in plain]  # the INT4 weights are what ran


def test_decode_gather_gives_each_pair_its_experts_weights(ckpt: Path) -> None:
    """The CUDA decode path's operands (routed_weights), run here through the plain experts'
    loop: each (token, slot) pair as its own expert gives the module's output (up to the CPU
    GEMM's order of summation: one row per call instead of an expert's rows together)."""
    model = load_model(ckpt, torch.float32, "cpu")
    model.fuse_projections()
    store_quantized(model, INT4)
    experts = model.model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, H, generator=g)
    ids = torch.tensor([[7, 2], [2, 7], [0, 5]])
    w = torch.rand(3, 2, generator=g)
    pairs, w13, w2 = experts.routed_weights(ids)
    assert pairs.tolist() == [[0, 1], [2, 3], [4, 5]] and w13.shape == (6, 2 * I, H)
    full13, full2 = experts.expert_weights()
    assert torch.equal(w13, full13[ids.reshape(-1)]) and torch.equal(w2, full2[ids.reshape(-1)])
    per_pair = StackedExperts(6, H, I)
    with torch.no_grad():
        per_pair.w13.copy_(w13)
        per_pair.w2.copy_(w2)
        torch.testing.assert_close(per_pair(x, pairs, w), experts(x, ids, w), rtol=1e-5, atol=1e-6)
        swapped = torch.tensor([[7, 2], [2, 7], [0, 4]])  # one expert off: visibly different
        assert not torch.allclose(per_pair(x, pairs, w), experts(x, swapped, w), rtol=1e-3, atol=1e-4)


def test_converted_int4_checkpoint_serves_the_experts_of_quantize_on_load(ckpt: Path, tmp_path: Path) -> None:
    """`milepost convert hf-to-int4` packs the experts too (the fourth stage); served as stored
    (int4 detected from the checkpoint) its experts' bytes and scales = quantize-on-load's."""
    from milepost.cli import main

    dst = tmp_path / "int4"
    assert main(["convert", "hf-to-int4", str(ckpt), str(dst)]) == 0
    kw = dict(device="cpu", dtype="float32", page_size=4, max_total_tokens=256)
    served = ServerArgs(model_path=dst, **kw).resolved()
    assert served.quantization == "int4"
    a = build_engine(served)[0].runner.model
    b = build_engine(ServerArgs(model_path=ckpt, quantization="int4", **kw).resolved())[0].runner.model
    for layer in (0, 1):
        ea, eb = a.model.layers[layer].mlp.experts, b.model.layers[layer].mlp.experts
        assert isinstance(ea, Int4StackedExperts)
        for p in ("w13", "w13_scale", "w2", "w2_scale"):
            assert torch.equal(getattr(ea, p), getattr(eb, p)), (layer, p)


def test_chunked_quantization_gives_the_same_bits(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing, dequantizing and fake-quantizing a few experts per call (uneven chunks: 3, 3, 2)
    gives the bits of one call over the whole stack."""
    from milepost.lowprec import experts_int4
    from milepost.lowprec.experts_int4 import _fake_quant, _pack, dequantize_packed

    def packed() -> StackedExperts:
        m = load_model(ckpt, torch.bfloat16, "cpu").model.layers[0].mlp.experts
        _pack(m)
        return m

    whole = packed()
    w13 = load_model(ckpt, torch.bfloat16, "cpu").model.layers[0].mlp.experts.w13.detach()
    whole_fq = _fake_quant(w13)
    whole_deq = dequantize_packed(whole.w2, whole.w2_scale, I, torch.bfloat16)
    monkeypatch.setattr(experts_int4, "_CHUNK_BYTES", 3 * 2 * I * H * 4)
    assert experts_int4._experts_per_chunk(2 * I * H) == 3
    chunked = packed()
    for p in ("w13", "w13_scale", "w2", "w2_scale"):
        assert torch.equal(getattr(chunked, p), getattr(whole, p)), p
    assert torch.equal(_fake_quant(w13), whole_fq)
    assert torch.equal(dequantize_packed(whole.w2, whole.w2_scale, I, torch.bfloat16), whole_deq)
    assert torch.equal(whole_fq, qdq(w13, "int4", "weight"))
