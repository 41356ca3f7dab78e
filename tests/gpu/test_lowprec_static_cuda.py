"""Static FP8 input scales on CUDA (`--fp8-activation-scheme static`): the shared input quantizer
gives the CPU's bits with and without a scale, also replayed from a CUDA graph (no host sync);
an fp8_block engine in bf16 whose tiles are whole runs the FP8 GEMM on the delayed trainer's
quantized inputs, agreeing with the trainer's forward. Run on the accelerator machine:
`python -m pytest -q -m gpu tests/gpu/test_lowprec_static_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.contract import Contract
from milepost.lowprec.delayed import (
    DelayedSettings,
    attach_delayed,
    qdq_input,
    quantize_input_blocks,
)
from milepost.lowprec.engine_store import store_quantized
from milepost.lowprec.linear import apply_train_precision
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FP8 = Contract("fp8_block", "fp8_block")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_input_quantizer_gives_the_cpu_bits_in_a_graph(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 512, generator=g) * torch.logspace(-3, 2, 512)).to(dtype)
    for scale in (x.float().abs().amax() / 300.0, torch.tensor(0.0)):  # static; none yet (1 x 128)
        cpu = qdq_input(x, scale)
        xs, ss = x.cuda(), scale.cuda()
        assert torch.equal(qdq_input(xs, ss).cpu(), cpu)
        out = qdq_input(xs, ss)  # warm up, then capture: no host sync in the function
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = qdq_input(xs, ss)
        graph.replay()
        assert torch.equal(out.cpu(), cpu)


def test_static_engine_runs_the_fp8_gemm_on_the_trainers_inputs(tmp_path: Path) -> None:
    """Whole tiles: the static engine's linears stay native (the block-scaled FP8 GEMM with every
    block scale the trainer's); their inputs are the delayed trainer's bits, the product agrees
    with the trainer's emulated forward to bf16's rounding, and a CUDA graph replays it."""
    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=4, with_tokenizer=False,
                                hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=64)
    dev = torch.device("cuda")
    tm = load_model(ckpt, torch.bfloat16, dev)
    apply_train_precision(tm, FP8)
    state = attach_delayed(tm, DelayedSettings(history_len=4), dev)
    down = tm.get_submodule("model.layers.0.mlp.down_proj")
    x = torch.randn(16, down.in_features, device=dev, dtype=torch.bfloat16) * 4
    down(x).float().square().sum().backward()
    state.step()
    em = load_model(ckpt, torch.bfloat16, dev)
    em.fuse_projections()
    store_quantized(em, FP8, static_scales=True)
    engine_down = em.model.layers[0].mlp.down_proj
    assert engine_down.native
    WeightLoader(em).from_named(state.input_scales())  # the weights: the same bf16 checkpoint
    scale = engine_down.input_scale[0]
    xq, sx = quantize_input_blocks(x, scale)
    slot = state.slot("model.layers.0.mlp.down_proj.weight", "x")
    assert torch.equal((xq.float() * sx.repeat_interleave(128, 1)).to(x.dtype),
                       state.qdq(x, slot, record=False))
    with torch.no_grad():
        got, want = engine_down(x), down(x)
        assert torch.allclose(got.float(), want.float(), rtol=1e-2,
                              atol=1e-2 * want.float().abs().amax().item())
        for m in (1, 16, 300):  # decode M (Triton), prefill M
            xm = torch.randn(m, down.in_features, device=dev, dtype=torch.bfloat16)
            out = engine_down(xm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = engine_down(xm)
            graph.replay()
            assert torch.equal(replayed, out)
