"""INT4 MoE experts with zero points (AWQ, asymmetric GPTQ / compressed-tensors served as stored) on
CUDA: at the Qwen3-30B-A3B expert shape the probe (which now covers zero points) passes; the experts'
forward with random zero points per expert, row and group equals the bf16 fused kernel on the
dequantized weights ((v - zero) * scale in float32, cast once to bf16) with the same config bit for
bit, is within bf16 rounding of an fp32 loop and of the gather-and-dequantize path, and is captured
in a CUDA graph; a tiny AWQ Qwen3-MoE engine (decode graphs on) gives the greedy tokens of
--dequantize-checkpoint, or parts from them only at a near-tie.

Run on the accelerator machine: `python -m pytest -q -s -m gpu tests/gpu/test_fused_moe_int4_zeros_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.testing.int4_moe_cuda import assert_replays_in_a_cuda_graph, packed_experts, run_fused_int4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def pair():
    """(INT4 experts with zero points, their dequantized bf16 weights w13 [E, 2I, H], w2 [E, H, I])."""
    mod = packed_experts(E, H, I, zero_points=True)
    with torch.no_grad():
        return mod, mod.expert_weights()


def test_probe_passes_and_the_triton_dequantization_gives_torchs_bits(pair) -> None:
    from milepost.kernels import fused_moe_int4 as f4
    from milepost.lowprec.experts_int4 import dequantize_packed

    mod, (w13, _) = pair
    assert f4.kernel_ok(mod.w13.device), "the fused INT4 MoE kernels failed their probe (see the log)"
    want = dequantize_packed(mod.w13, mod.w13_scale, H, torch.bfloat16, mod.w13_zero)
    assert torch.equal(w13, want)  # expert_weights took the Triton dequantization on CUDA


@pytest.mark.parametrize("tokens", [1, 4, 16, 64, 256])
def test_fused_int4_with_zeros_equals_the_bf16_kernel_on_dequantized_weights(pair, tokens: int) -> None:
    mod, (w13, w2) = pair
    r = run_fused_int4(mod, w13, w2, tokens, K)
    print(f"INT4_ZEROS tokens={tokens} bitwise vs bf16 kernel: {torch.equal(r.got, r.same_tiles)}")
    assert torch.equal(r.got, r.same_tiles), r.cfg.label()


def test_fused_int4_with_zeros_is_captured_in_a_cuda_graph(pair) -> None:
    assert_replays_in_a_cuda_graph(pair[0], H, E, K)


def test_engine_serves_an_awq_moe_checkpoint_on_the_fused_kernels(tmp_path: Path) -> None:
    """Decode CUDA graphs on: the experts are the checkpoint's nibbles, scales and zero points on
    the fused INT4 kernels; greedy tokens equal --dequantize-checkpoint's (bf16 weights on the bf16
    kernels) or part at a near-tie."""
    from test_engine_gpu_paths import PROMPTS, _assert_same_or_tie, _engine, _run

    from milepost.lowprec.experts_int4 import Int4StackedExperts
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.quant_checkpoints import write_awq

    make_tiny_checkpoint(tmp_path / "bf16", "qwen3_moe", hidden_size=160, moe_intermediate_size=136)
    write_awq(tmp_path / "bf16", tmp_path / "awq", 128)
    res = {}
    for run in ("stored", "dequantized"):
        engine = _engine(tmp_path / "awq", "bfloat16", True, dequantize_checkpoint=run == "dequantized")
        try:
            res[run] = _run(engine, PROMPTS, 16, 0.0)
            model = engine.runner.model
            if run == "stored":
                experts = model.model.layers[0].mlp.experts
                assert isinstance(experts, Int4StackedExperts) and experts.w13_zero is not None
                assert engine.runner.graphs is not None, "decode CUDA graphs are off"
            else:
                ref_model = model
        finally:
            engine.close()
    same = sum(a["ids"] == b["ids"] for a, b in zip(res["stored"], res["dequantized"]))
    print(f"INT4_ZEROS engine: {same}/{len(PROMPTS)} prompts with identical greedy tokens")
    _assert_same_or_tie(ref_model, PROMPTS, [o["ids"] for o in res["stored"]],
                        [o["ids"] for o in res["dequantized"]], 0.05, relative=True)
