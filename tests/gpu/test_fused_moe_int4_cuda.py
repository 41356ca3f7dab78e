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

from milepost.testing.int4_moe_cuda import assert_replays_in_a_cuda_graph, packed_experts, run_fused_int4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def pair():
    """(INT4 experts, their dequantized bf16 weights w13 [E, 2I, H], w2 [E, H, I])."""
    mod = packed_experts(E, H, I)
    with torch.no_grad():
        return mod, mod.expert_weights()


def test_probe_passes(pair) -> None:
    from milepost.kernels import fused_moe_int4 as f4

    assert f4.kernel_ok(pair[0].w13.device), "the fused INT4 MoE kernels failed their probe (see the log)"


@pytest.mark.parametrize("tokens", [1, 4, 15, 16, 64, 256])  # 15 * 8 < 128 <= 16 * 8
def test_fused_int4_equals_the_bf16_kernel_on_dequantized_weights(pair, tokens: int) -> None:
    """The engine's path (the fused INT4 kernels), reproducible, the bf16 kernel's bits with the
    same config, and within bf16 rounding of the path it replaced and of an fp32 loop."""
    mod, (w13, w2) = pair
    r = run_fused_int4(mod, w13, w2, tokens, K)
    with torch.inference_mode():
        assert torch.equal(r.got, mod(r.x, r.ids, r.w))  # reproducible
    assert torch.equal(r.got, r.same_tiles), r.cfg.label()
    diff = ((r.got.float() - r.old.float()).norm() / r.old.float().norm()).item()
    print(f"INT4_FUSED tokens={tokens} vs old path: rel {diff:.2e} bitwise {torch.equal(r.got, r.old)}")
    assert diff < 1e-2


def test_fused_int4_is_captured_in_a_cuda_graph(pair) -> None:
    assert_replays_in_a_cuda_graph(pair[0], H, E, K)
