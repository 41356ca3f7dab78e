"""Static FP8 input scales on CUDA (`--fp8-activation-scheme static`): the shared input quantizer
gives the CPU's bits with and without a scale, also replayed from a CUDA graph (no host sync);
an fp8_block engine in bf16 whose tiles are whole stays on the emulated GEMM under static scales
and its forward equals the delayed trainer's. Run on the accelerator machine:
`python -m pytest -q -m gpu tests/gpu/test_lowprec_static_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.weight_update import WeightLoader
from milepost.lowprec.contract import Contract
from milepost.lowprec.delayed import DelayedSettings, attach_delayed, qdq_input
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


def test_engine_with_static_scales_equals_the_delayed_trainer(tmp_path: Path) -> None:
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
    store = store_quantized(em, FP8, static_scales=True)
    engine_down = em.model.layers[0].mlp.down_proj
    assert not engine_down.native  # whole tiles, but the native kernels quantize per block
    WeightLoader(em).from_named(state.input_scales())  # the weights: the same bf16 checkpoint
    assert store.input_scales is not None
    with torch.no_grad():
        assert torch.equal(engine_down(x), down(x))
