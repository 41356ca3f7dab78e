"""FP8 blockwise MoE experts on CUDA (kernels/fused_moe_fp8.py, lowprec/engine_experts.py): bf16
activations with fp8 weights at the Qwen3-30B-A3B expert shape against an fp32 loop over the
dequantized weights, bitwise reproducible, captured in a CUDA graph, and an engine with
`--quantization fp8_block` on a tiny Qwen3-MoE whose experts run the FP8 kernels in its graphs.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_fused_moe_fp8_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.testing.moe_reference import expert_loop, routed_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 128, 2048, 768, 8


def _configs():
    from milepost.kernels import fused_moe_fp8 as f8

    fm = f8.fm
    cfgs = [fm.MoeConfig(16, fm.GemmConfig(64, 128), fm.GemmConfig(64, 128)),
            fm.MoeConfig(32, fm.GemmConfig(64, 64, 4, 4), fm.GemmConfig(128, 64), hist_align=True),
            fm.MoeConfig(64, fm.GemmConfig(128, 64, 8, 3), fm.GemmConfig(256, 64, 8, 3)),
            fm.MoeConfig(16, fm.GemmConfig(128, 128, swap_ab=True), fm.GemmConfig(64, 128, swap_ab=True))]
    cfgs += [f8.config_for(t, E, H, I, K) for t in (1, 16, 64, 256, 1024, 4096)]  # what engines run
    return list(dict.fromkeys(cfgs))




def _inputs(t: int, seed: int = 0):
    return routed_inputs(t, H, E, K, seed)


@pytest.fixture(scope="module")
def experts():
    from milepost.lowprec.engine_experts import _convert
    from milepost.models.qwen3_moe import StackedExperts

    torch.manual_seed(1)
    with torch.no_grad():
        mod = StackedExperts(E, H, I).cuda().bfloat16()
        mod.w13.normal_(0, 0.02)
        mod.w2.normal_(0, 0.02)
        _convert(mod)
    return mod


@pytest.mark.parametrize("tokens", [1, 100, 256, 2048])
def test_fp8_experts_match_the_dequantized_loop_at_the_30b_shape(experts, tokens: int) -> None:
    from milepost.kernels.fused_moe_fp8 import config_for, fused_expert_mlp_fp8

    m = experts
    x, ids, w = _inputs(tokens)
    with torch.inference_mode():
        ref = expert_loop(x, ids, w, m.dequantize_w13(), m.dequantize_w2())
        for cfg in _configs():
            got = fused_expert_mlp_fp8(x, ids, w, m.w13, m.w13_scale, m.w2, m.w2_scale, cfg)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            # the bf16 path's rounding points (its error vs an fp32 loop: 4.2e-3 on the H200)
            assert err < 1e-2, (cfg.label(), err)
            assert torch.equal(got, fused_expert_mlp_fp8(x, ids, w, m.w13, m.w13_scale, m.w2,
                                                         m.w2_scale, cfg)), cfg.label()
        cfg = config_for(tokens, E, H, I, K)  # the module's own dispatch runs the same
        assert torch.equal(m(x, ids, w), fused_expert_mlp_fp8(x, ids, w, m.w13, m.w13_scale, m.w2,
                                                              m.w2_scale, cfg))


@pytest.mark.parametrize("tokens", [1, 256, 2048])
def test_prescaled_fp8_experts_are_the_bf16_kernels_on_the_dequantized_weights(experts, tokens: int) -> None:
    """PRESCALE_FROM_TOKENS's kernels: bit for bit the bf16 kernels (kernels/fused_moe.py) with the
    same tiles on the bf16 weights the torch path dequantizes to, at every config engines run."""
    from milepost.kernels import fused_moe_fp8 as f8

    m = experts
    x, ids, w = _inputs(tokens)
    with torch.inference_mode():
        w13, w2 = m.dequantize_w13().bfloat16().contiguous(), m.dequantize_w2().bfloat16().contiguous()
        for cfg in _configs():
            got = f8.fused_expert_mlp_fp8(x, ids, w, m.w13, m.w13_scale, m.w2, m.w2_scale, cfg, prescale=True)
            want = f8.fm.fused_expert_mlp(x, ids, w, w13, w2, cfg)
            assert torch.equal(got, want), (cfg.label(), _first_difference(m, x, ids, w, w13, w2, cfg))


def _first_difference(m, x, ids, w, w13, w2, cfg) -> str:
    """Which stage of the prescaled path first differs from the bf16 kernels, and by how much (the
    session-29 failure at 256 and 2,048 tokens said only that the outputs differ)."""
    from milepost.kernels import fused_moe_fp8 as f8

    routing = f8.fm.align(ids.contiguous(), w13.shape[0], cfg.block_m, cfg.hist_align)
    again = f8.fm.align(ids.contiguous(), w13.shape[0], cfg.block_m, cfg.hist_align)
    rows = int(routing[2].item())
    # (entries past the rows in use are never written: only the used part is compared)
    same_routing = (torch.equal(routing[0][:rows], again[0][:rows])
                    and torch.equal(routing[1][: rows // cfg.block_m], again[1][: rows // cfg.block_m])
                    and torch.equal(routing[2], again[2]))
    k = ids.shape[1]
    act = f8.gate_up(x, m.w13, m.w13_scale.contiguous(), routing, k, cfg.block_m, cfg.gate_up,
                     prescale=True)[:rows]
    ref = f8.fm.gate_up(x, w13, routing, k, cfg.block_m, cfg.gate_up)[:rows]
    valid = routing[0][:rows] < ids.numel()
    bad = (act != ref)[valid]
    say = (f"routing repeatable {same_routing}; gate_up: {int(bad.any(1).sum())} of "
           f"{int(valid.sum())} rows differ, {int(bad.sum())} values, largest "
           f"{float((act - ref).float().abs()[valid].max()):.3e}")
    y = f8.down(ref, m.w2, m.w2_scale.contiguous(), routing, w.contiguous(), cfg.block_m, cfg.down,
                prescale=True)
    y_ref = f8.fm.down(ref, w2, routing, w.contiguous(), cfg.block_m, cfg.down)
    return say + f"; down on the same act: {int((y != y_ref).any(1).sum())} of {y.shape[0]} rows differ"


def test_fp8_experts_are_captured_in_a_cuda_graph(experts) -> None:
    from milepost.kernels.fused_moe_fp8 import fused_expert_mlp_fp8

    m = experts
    cfg = _configs()[1]
    x, ids, w = _inputs(64)
    args = (m.w13, m.w13_scale, m.w2, m.w2_scale, cfg)
    with torch.inference_mode():
        fused_expert_mlp_fp8(x, ids, w, *args)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_expert_mlp_fp8(x, ids, w, *args)
        x2, ids2, w2_ = _inputs(64, seed=5)
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2_)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_expert_mlp_fp8(x2, ids2, w2_, *args))


def test_engine_fp8_block_runs_fp8_experts_close_to_bf16(tmp_path: Path) -> None:
    """A tiny bf16 Qwen3-MoE (hidden 64: dense linears emulated, experts on the FP8 kernels) with
    decode CUDA graphs: every token gets its experts, the experts are fp8, the engine's greedy
    tokens are its own model's (or part at a near-tie of that model's reference logits), and the
    FP8 model's logits stay near bf16's. Greedy tokens of the two engines are
    not compared: on a tiny random model FP8's error flips many near-ties (H100, session 17: a
    parting at token 1 with a bf16 logit gap of 0.77)."""
    from test_engine_gpu_paths import PROMPTS, _assert_same_or_tie, _engine, _full_logits, _run

    from milepost.lowprec.engine_experts import Fp8StackedExperts
    from milepost.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, "qwen3_moe")
    res, models = {}, {}
    for run in ("bf16", "fp8_block"):
        engine = _engine(tmp_path, "bfloat16", True, quantization=None if run == "bf16" else run)
        try:
            res[run] = [o["ids"] for o in _run(engine, PROMPTS, 16, 0.0)]
            models[run] = engine.runner.model
            if run == "fp8_block":
                assert isinstance(models[run].model.layers[0].mlp.experts, Fp8StackedExperts)
                assert engine.runner.graphs is not None, "decode CUDA graphs are off"
        finally:
            engine.close()
    assert all(len(ids) == 16 for ids in res["fp8_block"])
    _assert_same_or_tie(models["fp8_block"], PROMPTS, res["fp8_block"],
                        [_greedy_reference(models["fp8_block"], p, 16) for p in PROMPTS], 0.25,
                        relative=True)
    errs = []
    for prompt, out in zip(PROMPTS, res["bf16"]):
        ref = _full_logits(models["bf16"], prompt + out).float()
        got = _full_logits(models["fp8_block"], prompt + out).float()
        errs.append(((got - ref).norm() / ref.norm()).item())
    print(f"FP8_ENGINE logits vs bf16, relative error per prompt: {[f'{e:.3f}' for e in errs]}")
    # H100, 2026-12-06: 0.086 to 0.210 (hidden 64: every weight in FP8 with 3 mantissa bits, the
    # tiny model's small logits). Wrong scales or experts dropped give errors near 1.
    assert max(errs) < 0.35, errs


def _greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation from the model's full-sequence reference logits (no cache, no graphs)."""
    from test_engine_gpu_paths import _full_logits

    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_full_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]
