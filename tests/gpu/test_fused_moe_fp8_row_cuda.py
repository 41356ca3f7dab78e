"""Per-channel FP8 MoE experts on CUDA (lowprec/experts_fp8_row.py; kernels/fused_moe_fp8.py with
row scales read as [N, 1] block scales): bf16 activations at the Qwen3-30B-A3B expert shape against
an fp32 loop over the dequantized weights, bitwise reproducible, captured in a CUDA graph; and an
engine serving a tiny Qwen3-MoE in compressed-tensors' FP8-dynamic layout as stored, its experts on
the fused FP8 kernels in its decode graphs, against `--dequantize-checkpoint`.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_fused_moe_fp8_row_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.testing.moe_reference import expert_loop, routed_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def experts():
    """Row-scaled experts quantized per row from normal weights (the row store's quantizer)."""
    from milepost.lowprec.experts_fp8_row import _convert_rows
    from milepost.models.qwen3_moe import StackedExperts
    from milepost.weights.fp8 import quantize_rows

    torch.manual_seed(1)
    with torch.no_grad():
        mod = StackedExperts(E, H, I).cuda().bfloat16()
        w13 = torch.randn(E * 2 * I, H, device="cuda") * 0.02
        w2 = torch.randn(E * H, I, device="cuda") * 0.02
        _convert_rows(mod)
        for src, values, scales in ((w13, mod.w13, mod.w13_scale), (w2, mod.w2, mod.w2_scale)):
            v, s = quantize_rows(src)
            values.copy_(v.reshape(values.shape))
            scales.copy_(s.reshape(scales.shape))
    return mod


@pytest.mark.parametrize("tokens", [1, 100, 2048])
def test_row_scaled_experts_match_the_dequantized_loop_at_the_30b_shape(experts, tokens: int) -> None:
    from milepost.kernels import fused_moe_fp8 as f8

    m = experts
    x, ids, w = routed_inputs(tokens, H, E, K)
    cfgs = [f8.config_for(tokens, E, H, I, K),
            f8.fm.MoeConfig(16, f8.fm.GemmConfig(128, 128, swap_ab=True),
                            f8.fm.GemmConfig(64, 128, swap_ab=True))]
    with torch.inference_mode():
        ref = expert_loop(x, ids, w, m.dequantize_w13(), m.dequantize_w2())
        for cfg in cfgs:
            got = f8.fused_expert_mlp_fp8(x, ids, w, m.w13, m.w13_scale, m.w2, m.w2_scale, cfg,
                                          row_scales=True)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (cfg.label(), err)  # the bf16 path's rounding points
            assert torch.equal(got, f8.fused_expert_mlp_fp8(x, ids, w, m.w13, m.w13_scale, m.w2,
                                                            m.w2_scale, cfg, row_scales=True))
        assert torch.equal(m(x, ids, w), f8.fused_expert_mlp_fp8(  # the module's own dispatch
            x, ids, w, m.w13, m.w13_scale, m.w2, m.w2_scale, cfgs[0], row_scales=True))


def test_row_scaled_experts_are_captured_in_a_cuda_graph(experts) -> None:
    m = experts
    x, ids, w = routed_inputs(64, H, E, K)
    with torch.inference_mode():
        m(x, ids, w)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(x, ids, w)
        x2, ids2, w2 = routed_inputs(64, H, E, K, seed=5)
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, m(x2, ids2, w2))


def test_engine_serves_a_per_channel_checkpoint_on_the_fused_kernels(tmp_path: Path) -> None:
    """Decode CUDA graphs on: the experts are the checkpoint's float8 rows on the FP8 kernels, the
    greedy tokens equal --dequantize-checkpoint's (bf16 weights on the bf16 kernels) or part at a
    near-tie (the two sum the same products in another order)."""
    from test_engine_gpu_paths import PROMPTS, _assert_same_or_tie, _engine, _run

    from milepost.lowprec.experts_fp8_row import Fp8RowStackedExperts
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.quant_checkpoints import write_fp8

    make_tiny_checkpoint(tmp_path / "bf16", "qwen3_moe")
    write_fp8(tmp_path / "bf16", tmp_path / "ch", "channel")
    res = {}
    for run in ("stored", "dequantized"):
        engine = _engine(tmp_path / "ch", "bfloat16", True, dequantize_checkpoint=run == "dequantized")
        try:
            res[run] = _run(engine, PROMPTS, 16, 0.0)
            model = engine.runner.model
            if run == "stored":
                assert isinstance(model.model.layers[0].mlp.experts, Fp8RowStackedExperts)
                assert engine.runner.graphs is not None, "decode CUDA graphs are off"
            else:
                ref_model = model
        finally:
            engine.close()
    assert all(len(o["ids"]) == 16 for o in res["stored"])
    _assert_same_or_tie(ref_model, PROMPTS, [o["ids"] for o in res["stored"]],
                        [o["ids"] for o in res["dequantized"]], 0.05, relative=True)
