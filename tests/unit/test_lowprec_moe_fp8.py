"""FP8 blockwise MoE experts (`--quantization fp8_block`): the fused FP8 kernels (kernels/
fused_moe_fp8.py) against dequantize-then-matmul, the engine's store (lowprec/engine_experts.py)
holding the one quantizer's bits per HF tensor and re-quantizing them on every update, and the
engine's greedy tokens against transformers on the dequantized weights.

Without CUDA the kernels run under Triton's interpreter, in fp32 (the interpreter's bf16 tl.dot is
wrong; bf16 at the 30B-A3B shape is checked on the GPU: tests/gpu/test_fused_moe_fp8_cuda.py).
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

from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.contract import Contract, parse_overrides
from milepost.lowprec.engine_experts import Fp8StackedExperts, _convert
from milepost.lowprec.engine_store import store_quantized
from milepost.lowprec.quantize import dequantize, error_bound, quantize
from milepost.models.qwen3_moe import StackedExperts
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.hopper_compile import needs_ptxas, run_compiled

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS_ONLY = parse_overrides(["*.self_attn.*=bf16"])  # dense linears bf16: the experts alone


def _experts(experts: int, hidden: int, inter: int, seed: int) -> tuple[Fp8StackedExperts, torch.Tensor, torch.Tensor]:
    """Fp8 experts whose tiles differ in magnitude by orders (gate vs up, column tiles, experts),
    so a scale read from the wrong tile changes the result; returns (module, w13, w2) before."""
    g = torch.Generator().manual_seed(seed)
    mod = StackedExperts(experts, hidden, inter)
    with torch.no_grad():
        col = torch.where(torch.arange(hidden) < 128, 1.0, 30.0)  # the second K tile of w13
        w13 = torch.randn(mod.w13.shape, generator=g) * 0.05 * col
        w13[:, inter:] *= 0.05  # up's tiles apart from gate's
        w13 *= torch.logspace(-1, 0.5, experts)[:, None, None]
        w2 = torch.randn(mod.w2.shape, generator=g) * 0.2
        w2[:, 128:] *= 1e-2  # the second row tile of w2 (hidden > 128)
        mod.w13.copy_(w13)
        mod.w2.copy_(w2)
        _convert(mod)
    return mod.to(DEV), w13, w2


def _routing(t: int, experts: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    return ids.to(DEV), torch.rand(t, k, generator=g).to(DEV)


@pytest.mark.parametrize("block_n,block_k,swap", [(32, 64, False), (64, 128, True)])
def test_fp8_expert_kernels_equal_dequantize_then_matmul(block_n: int, block_k: int, swap: bool) -> None:
    """hidden 160: two K tiles of w13 (the second partial) and two row tiles of w2; intermediate 48
    < 128: gate and up each own a partial tile row (scales [E, 2, 1, 2]); BLOCK_K 64 runs two K
    steps per scale block."""
    experts, hidden, inter, k, t = 5, 160, 48, 2, 6
    mod, _, _ = _experts(experts, hidden, inter, seed=0)
    assert mod.w13.dtype == torch.float8_e4m3fn and tuple(mod.w13_scale.shape) == (experts, 2, 1, 2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, hidden, generator=g).to(DEV)
    ids, w = _routing(t, experts, k, g)
    w13, w2 = mod.dequantize_w13(), mod.dequantize_w2()  # the reference's operands
    ref = _loop(x, ids, w, w13, w2)
    cfg = f8.MoeConfig(16, f8.GemmConfig(block_n, block_k, swap_ab=swap),
                       f8.GemmConfig(block_n, block_k, swap_ab=swap), hist_align=swap)
    got = f8.fused_expert_mlp_fp8(x, ids, w, mod.w13, mod.w13_scale, mod.w2, mod.w2_scale, cfg)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    again = f8.fused_expert_mlp_fp8(x, ids, w, mod.w13, mod.w13_scale, mod.w2, mod.w2_scale, cfg)
    assert torch.equal(got, again)
    with pytest.raises(ValueError, match="BLOCK_K dividing 128"):
        f8.gate_up(x, mod.w13, mod.w13_scale, f8.fm.align(ids, experts, 16), k, 16,
                   f8.GemmConfig(32, 256))


@pytest.mark.parametrize("block_k,swap", [(64, False), (128, True)])
def test_prescaled_fp8_kernels_are_the_bf16_kernels_on_the_dequantized_weights(
        block_k: int, swap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prescaled (each weight tile scaled and rounded to the activation dtype before the MMA):
    bit for bit the bf16 path's kernels (kernels/fused_moe.py) on the weights the torch path
    dequantizes to, with the same tiles; PRESCALE_FROM_TOKENS picks it by the token count."""
    experts, hidden, inter, k, t = 5, 160, 48, 2, 7
    mod, _, _ = _experts(experts, hidden, inter, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(t, hidden, generator=g).to(DEV)
    ids, w = _routing(t, experts, k, g)
    w13, w2 = mod.dequantize_w13().to(x.dtype), mod.dequantize_w2().to(x.dtype)
    cfg = f8.MoeConfig(16, f8.GemmConfig(32, block_k, swap_ab=swap),
                       f8.GemmConfig(32, block_k, swap_ab=swap), hist_align=swap)
    fp8 = (x, ids, w, mod.w13, mod.w13_scale, mod.w2, mod.w2_scale, cfg)
    want = f8.fm.fused_expert_mlp(x, ids, w, w13.contiguous(), w2.contiguous(), cfg)
    assert torch.equal(f8.fused_expert_mlp_fp8(*fp8, prescale=True), want)
    unscaled = f8.fused_expert_mlp_fp8(*fp8, prescale=False)
    torch.testing.assert_close(unscaled, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert not torch.equal(unscaled, want)  # scaling the products rounds otherwise
    monkeypatch.setattr(f8, "PRESCALE_FROM_TOKENS", t)
    assert torch.equal(f8.fused_expert_mlp_fp8(*fp8), want)
    monkeypatch.setattr(f8, "PRESCALE_FROM_TOKENS", t + 1)
    assert torch.equal(f8.fused_expert_mlp_fp8(*fp8), unscaled)


def _loop(x, ids, w, w13, w2) -> torch.Tensor:
    """fp32 reference: each (token, slot) pair by hand."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w[t, s] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_store_holds_each_hf_tensors_quantized_bits_and_dequantizes_on_cpu() -> None:
    """The batched conversion (intermediate 128: whole tile rows) equals the quantizer per HF
    tensor, bit for bit; off CUDA the module's forward runs the loop on the dequantized weights."""
    experts, hidden, inter = 3, 256, 128
    mod, w13, w2 = _experts(experts, hidden, inter, seed=2)
    for e, which, src in ((0, 0, w13[0, :inter]), (1, 1, w13[1, inter:]), (2, 2, w2[2])):
        q, held = quantize(src, "fp8_block"), mod.qtensor(e, which)
        assert torch.equal(held.values.cpu().view(torch.uint8), q.values.view(torch.uint8))
        assert torch.equal(held.scales.cpu(), q.scales)
    if DEV == "cpu":
        g = torch.Generator().manual_seed(3)
        x = torch.randn(4, hidden, generator=g)
        ids, w = _routing(4, experts, 2, g)
        with torch.no_grad():
            ref = _loop(x, ids, w, mod.dequantize_w13(), mod.dequantize_w2())
            torch.testing.assert_close(mod(x, ids, w), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe_fp8") / "m", "qwen3_moe", seed=4,
                                with_tokenizer=False)


def test_contract_serves_experts_in_fp8_and_trains_them_in_bf16() -> None:
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    for arrangement in (Contract("bf16", "fp8_block"), Contract("fp8_block", "fp8_block")):
        assert arrangement.tensor_format(name, "rollout") == "fp8_block"
        assert arrangement.tensor_format(name, "train") == "bf16"  # bf16-train-fp8-serve
    assert Contract("nvfp4", "nvfp4").tensor_format(name, "rollout") == "bf16"
    keep = Contract("fp8_block", "fp8_block", parse_overrides(["*.experts.*=bf16"]))
    assert keep.tensor_format(name, "rollout") == "bf16"


def test_updates_requantize_experts_and_the_check_admits_the_bound(moe_ckpt: Path) -> None:
    model = load_model(moe_ckpt, torch.float32, "cpu")
    model.fuse_projections()
    store = store_quantized(model, Contract("fp8_block", "fp8_block"))
    assert isinstance(model.model.layers[1].mlp.experts, Fp8StackedExperts)
    sent = {n: t * 3.0 - 0.01 for n, t in load_file(moe_ckpt / "model.safetensors").items()}
    assert WeightLoader(model).from_named(sent.items(), strict_dtype=True) == len(sent)
    for name in ("model.layers.0.mlp.experts.2.gate_proj.weight",
                 "model.layers.1.mlp.experts.7.up_proj.weight",
                 "model.layers.1.mlp.experts.0.down_proj.weight"):
        view = model.weight_view(name)
        assert store.owner(view) is not None and store.format_of(view) == "fp8_block"
        values, scale = store.dequantized(view)
        assert torch.equal(values, dequantize(quantize(sent[name], "fp8_block")))  # re-quantized
        assert ((values - sent[name]).abs() <= error_bound("fp8_block", sent[name], scale)).all()
    # transformers 5's fused name addresses every expert of a layer at once
    fused = model.weight_view("model.layers.0.mlp.experts.gate_up_proj")
    values, _ = store.dequantized(fused)
    inter = model.hf_config.moe_intermediate_size
    up5 = sent["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert torch.equal(values[5, inter:], dequantize(quantize(up5, "fp8_block")))
    store.write(fused, values.flip(0))  # every expert's gate / up from one tensor
    assert torch.equal(store.dequantized(model.weight_view(
        "model.layers.0.mlp.experts.2.up_proj.weight"))[0], values[-3, inter:])
    norm = "model.layers.0.input_layernorm.weight"
    assert store.owner(model.weight_view(norm)) is None


def test_engine_greedy_with_fp8_experts_equals_transformers_on_dequantized_weights(
        moe_ckpt: Path, tmp_path: Path) -> None:
    """Only the experts quantized (dense linears overridden to bf16): the engine's greedy tokens
    equal transformers `generate` on a checkpoint whose expert tensors are the quantizer's
    dequantized values."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    args = ServerArgs(model_path=moe_ckpt, device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=8, max_total_tokens=256, quantization="fp8_block",
                      precision_override="*.self_attn.*=bf16").resolved()
    engine = build_engine(args)[0]
    experts = engine.runner.model.model.layers[0].mlp.experts
    assert isinstance(experts, Fp8StackedExperts) and experts.w13.dtype == torch.float8_e4m3fn
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 4)]
    got: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                              on_output=lambda o, i=i: got.setdefault(i, []).extend(o.new_token_ids)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    sd = load_file(moe_ckpt / "model.safetensors")
    sd = {n: dequantize(quantize(t, "fp8_block")) if ".experts." in n else t for n, t in sd.items()}
    ref_dir = tmp_path / "deq"
    ref_dir.mkdir()
    save_file(sd, ref_dir / "model.safetensors", metadata={"format": "pt"})
    (ref_dir / "config.json").write_bytes((moe_ckpt / "config.json").read_bytes())
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, attn_implementation="eager").eval()
    cfg = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    plain = AutoModelForCausalLM.from_pretrained(moe_ckpt, attn_implementation="eager").eval()
    differs = False
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), generation_config=cfg)[0, len(p):].tolist()
            assert got[i] == want, i
            logits_q = ref(torch.tensor([p])).logits
            differs |= not torch.equal(logits_q, plain(torch.tensor([p])).logits)
    assert differs  # the quantized experts are what the engine ran (their logits differ)


def test_every_shape_gets_an_fp8_config_with_block_k_in_one_scale_block(monkeypatch) -> None:
    """No grouped alternative for fp8 experts: unmeasured shapes and token counts past the last
    bucket get a config; a bf16 entry with BLOCK_K 256 (or None: grouped faster) is adapted."""
    bf16 = f8.MoeConfig(32, f8.GemmConfig(64, 256), f8.GemmConfig(128, 64))
    monkeypatch.setattr(f8.fm, "MEASURED", {(4, 64, 32, 2): ((8, None), (64, bf16))})
    assert f8.config_for(3, 4, 64, 32, 2).gate_up.block_k == 128  # None skipped, K capped
    assert f8.config_for(5000, 4, 64, 32, 2).down == bf16.down  # past the last bucket: the last
    assert f8.config_for(1, 9, 64, 32, 2) is not None  # a shape no table has
    mine = f8.MoeConfig(16, f8.GemmConfig(32, 64), f8.GemmConfig(32, 64))
    monkeypatch.setattr(f8, "MEASURED_FP8", {(4, 64, 32, 2): ((1024, mine),)})
    assert f8.config_for(3, 4, 64, 32, 2) == mine


def test_checkpoint_conversion_quantizes_expert_tensors(moe_ckpt: Path, tmp_path: Path) -> None:
    """The fourth stage follows the contract: per-expert tensors in FP8 with their tile scales,
    the router in bf16; an override keeps the experts unquantized."""
    from milepost.lowprec.convert import convert_checkpoint

    names = convert_checkpoint(moe_ckpt, tmp_path / "a", Contract("fp8_block", "fp8_block"))
    down = "model.layers.1.mlp.experts.6.down_proj.weight"
    assert down in names and "model.layers.1.mlp.gate.weight" not in names
    out, src = load_file(tmp_path / "a" / "model.safetensors"), load_file(moe_ckpt / "model.safetensors")
    q = quantize(src[down], "fp8_block")
    assert torch.equal(out[down].view(torch.uint8), q.values.view(torch.uint8))
    assert torch.equal(out[down.removesuffix("weight") + "weight_scale_inv"], q.scales)
    keep = Contract("fp8_block", "fp8_block", parse_overrides(["*.experts.*=bf16"]))
    assert not any(".experts." in n for n in convert_checkpoint(moe_ckpt, tmp_path / "b", keep))


def test_w8a8_kernels_equal_quantize_everything_then_matmul() -> None:
    """act_fp8=True (--fp8-w8a8-experts): tokens and activation rows quantized per 1 x 128 by the
    activation quantizer, both MMA operands fp8; equals the fp32 product of the
    quantized-dequantized operands."""
    from milepost.lowprec.linear import qdq

    experts, hidden, inter, k, t = 4, 256, 128, 2, 5
    mod, _, _ = _experts(experts, hidden, inter, seed=6)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, hidden, generator=g)
    ids, w = _routing(t, experts, k, g)
    w13, w2 = mod.dequantize_w13().cpu(), mod.dequantize_w2().cpu()
    xq, ref = qdq(x, "fp8_block"), torch.zeros(t, hidden)
    for i in range(t):
        for s in range(k):
            e = int(ids[i, s])
            gate, up = (w13[e] @ xq[i]).chunk(2)
            act = qdq((torch.nn.functional.silu(gate) * up)[None], "fp8_block")[0]
            ref[i] += w[i, s].cpu() * (w2[e] @ act)
    for swap in (False, True):
        cfg = f8.MoeConfig(16, f8.GemmConfig(64, 128, swap_ab=swap), f8.GemmConfig(64, 64, swap_ab=swap))
        got = f8.fused_expert_mlp_fp8(x.to(DEV), ids, w, mod.w13, mod.w13_scale, mod.w2, mod.w2_scale,
                                      cfg, act_fp8=True).cpu()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_w8a8_off_the_fused_path_matches_the_kernels() -> None:
    """W8A8 experts (act_fp8, --fp8-w8a8-experts): the CPU path (loop on dequantized weights)
    quantizes the same activations as the W8A8 kernels: one result, whichever path runs."""
    experts, hidden, inter, k, t = 4, 256, 128, 2, 5
    mod, _, _ = _experts(experts, hidden, inter, seed=8)
    assert not mod.act_fp8  # W8A16 unless asked
    mod.act_fp8 = True
    g = torch.Generator().manual_seed(9)
    x = torch.randn(t, hidden, generator=g).to(DEV)
    ids, w = _routing(t, experts, k, g)
    cfg = f8.MoeConfig(16, f8.GemmConfig(64, 128), f8.GemmConfig(64, 128))
    fused = f8.fused_expert_mlp_fp8(x, ids, w, mod.w13, mod.w13_scale, mod.w2, mod.w2_scale, cfg,
                                    act_fp8=True)
    with torch.no_grad():
        loop = mod(x, ids, w)  # not inference mode: the loop
    torch.testing.assert_close(loop, fused, rtol=1e-4, atol=1e-4 * fused.abs().max().item())


def _greedy_logprobs(args: object, prompt: list[int]) -> tuple[list[int], list[float]]:
    from milepost.engine.request import Request
    from milepost.engine.sampling import SamplingParams
    from milepost.engine.setup import build_engine

    engine = build_engine(args)[0]
    tokens: list[int] = []
    logprobs: list[float] = []

    def on_output(o: object) -> None:
        tokens.extend(o.new_token_ids)
        logprobs.extend(o.new_logprobs)

    engine.submit(Request(rid="a", prompt_ids=prompt, stop_ids=frozenset(), on_output=on_output,
                          return_logprob=True,
                          params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    layers = engine.runner.model.model.layers
    assert all(m.mlp.experts.act_fp8 == args.fp8_w8a8_experts for m in layers
               if isinstance(m.mlp.experts, Fp8StackedExperts))
    engine.close()
    return tokens, logprobs


def test_fp8_w8a8_experts_setting_quantizes_the_expert_inputs(moe_ckpt: Path, tmp_path: Path) -> None:
    """--fp8-w8a8-experts: every FP8 expert layer quantizes its inputs (the engine's log-probs
    move away from W8A16's by the activation rounding, not by more than a few tenths); refused
    without the fp8_block store, and for experts whose sizes are not whole 1 x 128 blocks."""
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine

    ckpt = make_tiny_checkpoint(tmp_path / "m128", "qwen3_moe", seed=4, with_tokenizer=False,
                                hidden_size=128, moe_intermediate_size=128)
    prompt = list(range(7, 19))
    base = dict(model_path=ckpt, device="cpu", dtype="float32", page_size=4,
                max_total_tokens=256, quantization="fp8_block")
    w8a16 = _greedy_logprobs(ServerArgs(**base).resolved(), prompt)
    w8a8 = _greedy_logprobs(ServerArgs(**base, fp8_w8a8_experts=True).resolved(), prompt)
    first = abs(w8a8[1][0] - w8a16[1][0])
    assert 0 < first < 0.5, first
    with pytest.raises(ValueError, match="--fp8-w8a8-experts .* add --quantization fp8_block"):
        ServerArgs(model_path=moe_ckpt, device="cpu", fp8_w8a8_experts=True).resolved()
    with pytest.raises(ValueError, match="hidden size 64 and moe_intermediate_size 32 must both divide"):
        build_engine(ServerArgs(**{**base, "model_path": moe_ckpt}, fp8_w8a8_experts=True).resolved())
    with pytest.raises(ValueError, match="--fp8-w8a8-experts .* int4"):
        ServerArgs(**{**base, "quantization": "int4"}, fp8_w8a8_experts=True).resolved()


# Compiled for the H100/H200 (sm_90) with Triton's bundled ptxas, in a process of its own (this
# module runs the interpreter without CUDA). Tiles of the committed 30B-A3B decode configs.
_COMPILE_PRESCALED = """
from milepost.kernels import fused_moe as fm, fused_moe_fp8 as f8
from milepost.testing.hopper_compile import sm90_mma_waits

common = dict(SORTED="*i32", BLOCK_EXPERT="*i32", TOTAL="*i32")
ints = ("inter", "hidden")
for bm, swap in ((16, True), (32, False)):
    c = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, EVEN_K=True, SWAP=swap, TOP_K=8)
    bf16, _ = sm90_mma_waits(fm._gate_up_kernel, dict(X="*bf16", W13="*bf16", **common, ACT="*bf16"), c, ints)
    got = {}
    for pre in (False, True):
        got[pre] = sm90_mma_waits(f8._gate_up_fp8_kernel, dict(X="*bf16", W13="*fp8e4nv", S13="*fp32",
                                  **common, ACT="*bf16"), {**c, "SCALE_N": 128, "PRESCALE": pre}, ints)
        assert got[pre][0] == bf16, (bm, swap, pre, got[pre][0], bf16)  # the bf16 kernel's MMAs
    if swap:  # the weight tile is the register operand: prescaled, MMAs stay in flight
        assert max(got[True][1]) > 0 and max(got[False][1]) == 0, (got[True][1], got[False][1])
"""


@needs_ptxas()
def test_prescaled_kernels_compile_for_hopper_with_the_bf16_kernels_mmas() -> None:
    """The prescaled W8A16 kernels issue the bf16 kernels' MMA instructions (so the same sums on
    the GPU as on the dequantized bf16 weights), and with the weight rows on the MMA's M side they
    wait for MMAs only with some still in flight, where scaling each product waits for all."""
    run_compiled(_COMPILE_PRESCALED)
