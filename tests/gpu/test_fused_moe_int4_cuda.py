"""The fused W4A16 MoE kernels (kernels/fused_moe_int4.py) on CUDA at the Qwen3-30B-A3B expert shape:
the probe passes; the INT4 experts' forward (which takes them up to 256 tokens) equals the bf16
fused kernel on the dequantized weights with the same config bit for bit (the same tiles and MMA
instructions: tests/unit/test_fused_moe_int4.py compares the sm_90 PTX), is within bf16 rounding
of the path it replaced (decode: the routed experts dequantized into copies, then the bf16
experts) and of an fp32 loop, and is captured in a CUDA graph.

Run on the accelerator machine: `python -m pytest -q -s -m gpu tests/gpu/test_fused_moe_int4_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from milepost.testing.moe_reference import expert_loop, routed_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def pair():
    """(INT4 experts, their dequantized bf16 weights w13 [E, 2I, H], w2 [E, H, I])."""
    from milepost.lowprec.experts_int4 import _pack
    from milepost.models.qwen3_moe import StackedExperts

    torch.manual_seed(1)
    with torch.no_grad():
        mod = StackedExperts(E, H, I).cuda().bfloat16()
        mod.w13.normal_(0, 0.02)
        mod.w2.normal_(0, 0.02)
        _pack(mod)  # probes the kernels
        return mod, mod.expert_weights()


def test_probe_passes(pair) -> None:
    from milepost.kernels import fused_moe_int4 as f4

    assert f4.kernel_ok(pair[0].w13.device), "the fused INT4 MoE kernels failed their probe (see the log)"


@pytest.mark.parametrize("tokens", [1, 4, 15, 16, 64, 256])  # 15 * 8 < 128 <= 16 * 8
def test_fused_int4_equals_the_bf16_kernel_on_dequantized_weights(pair, tokens: int) -> None:
    from milepost.kernels import fused_moe as fm
    from milepost.kernels import fused_moe_int4 as f4

    mod, (w13, w2) = pair
    x, ids, w = routed_inputs(tokens, H, E, K, seed=tokens)
    cfg = f4.config_for(tokens, E, H, I, K)
    with torch.inference_mode():
        got = mod(x, ids, w)
        assert torch.equal(got, f4.fused_expert_mlp_int4(x, ids, w, mod.w13, mod.w13_scale, mod.w2,
                                                         mod.w2_scale, cfg))  # the engine's path
        assert torch.equal(got, mod(x, ids, w))  # reproducible
        same_tiles = fm.fused_expert_mlp(x, ids, w, w13, w2, cfg)
        assert torch.equal(got, same_tiles), cfg.label()
        # the path it replaced: routed copies + bf16 experts at decode, every expert dequantized above
        old = mod._routed_only(x, ids, w) if tokens * K < E else super(type(mod), mod).forward(x, ids, w)
        ref = expert_loop(x, ids, w, w13, w2)
        for y in (got, old):
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (tokens, err)
        diff = ((got.float() - old.float()).norm() / old.float().norm()).item()
        print(f"INT4_FUSED tokens={tokens} vs old path: rel {diff:.2e} bitwise {torch.equal(got, old)}")
        assert diff < 1e-2


def test_fused_int4_is_captured_in_a_cuda_graph(pair) -> None:
    mod, _ = pair
    x, ids, w = routed_inputs(4, H, E, K, seed=0)
    with torch.inference_mode():
        mod(x, ids, w)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mod(x, ids, w)
        x2, ids2, w2 = routed_inputs(4, H, E, K, seed=5)
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mod(x2, ids2, w2))
