"""INT4 MoE experts on CUDA (lowprec/experts_int4.py): at the Qwen3-30B-A3B expert shape the
Triton dequantization gives torch's bf16 bits; the forward (up to 256 tokens the fused INT4
kernels, tests/gpu/test_fused_moe_int4_cuda.py; larger batches: every expert dequantized) equals
the bf16 expert path on the dequantized weights bit for bit (the fused bf16 kernels on the INT4
config, or the plain path where every expert is dequantized) and an fp32 loop within bf16's
rounding, is reproducible and captured in a CUDA graph;
an engine with `--quantization int4` on a tiny Qwen3-MoE records every token's routed experts
and gives the greedy tokens of a bf16 engine on the dequantized weights (or parts at a near-tie).
Prints decode times (bf16 experts vs INT4 experts) per layer.

Run on the accelerator machine: `python -m pytest -q -s -m gpu tests/gpu/test_int4_experts_cuda.py`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from milepost.testing.int4_moe_cuda import assert_replays_in_a_cuda_graph, packed_experts
from milepost.testing.moe_reference import expert_loop, routed_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 128, 2048, 768, 8


def _inputs(t: int, seed: int = 0):
    return routed_inputs(t, H, E, K, seed)


@pytest.fixture(scope="module")
def pair():
    """(INT4 experts, bf16 StackedExperts holding their dequantized weights)."""
    from milepost.models.qwen3_moe import StackedExperts

    mod = packed_experts(E, H, I)
    with torch.no_grad():
        plain = StackedExperts(E, H, I).cuda().bfloat16()
        w13, w2 = mod.expert_weights()
        plain.w13.copy_(w13)
        plain.w2.copy_(w2)
    return mod, plain


def test_triton_dequantization_gives_torchs_bf16_bits(pair) -> None:
    from milepost.kernels.int4_gemm import kernel_ok
    from milepost.lowprec.experts_int4 import dequantize_packed

    mod, _ = pair
    assert kernel_ok(mod.w13.device), "the INT4 kernels failed their probe (see the log)"
    w13, w2 = mod.expert_weights()  # the Triton kernel
    assert torch.equal(w13, dequantize_packed(mod.w13, mod.w13_scale, H, torch.bfloat16))
    assert torch.equal(w2, dequantize_packed(mod.w2, mod.w2_scale, I, torch.bfloat16))


@pytest.mark.parametrize("tokens", [1, 4, 15, 16, 100, 2048])  # 15 * 8 < 128 <= 16 * 8
def test_int4_experts_match_the_bf16_path_on_dequantized_weights(pair, tokens: int) -> None:
    from milepost.kernels import fused_moe as fm
    from milepost.kernels import fused_moe_int4 as f4

    mod, plain = pair
    x, ids, w = _inputs(tokens)
    with torch.inference_mode():
        got, want = mod(x, ids, w), plain(x, ids, w)
        ref = expert_loop(x, ids, w, plain.w13, plain.w2)
        assert torch.equal(got, mod(x, ids, w))  # reproducible
        if tokens > f4.MAX_TOKENS:  # every expert dequantized: the plain path on the same weights
            assert torch.equal(got, want)
        elif tokens * K >= E:  # the fused INT4 kernels: the bf16 kernels' bits on their config
            cfg = f4.config_for(tokens, E, H, I, K)
            assert torch.equal(got, fm.fused_expert_mlp(x, ids, w, plain.w13, plain.w2, cfg)), cfg.label()
        for y in (got, want):
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (tokens, err)


def test_decode_path_is_captured_in_a_cuda_graph(pair) -> None:
    assert_replays_in_a_cuda_graph(pair[0], H, E, K)


def test_print_decode_times(pair) -> None:
    """Not asserted (benchmarks/int4_moe_gpu.py times the fused INT4 kernels over several
    layers' weights): ms per layer call of bf16 experts and INT4 experts."""
    mod, plain = pair
    for tokens in (1, 8, 32, 256):
        x, ids, w = _inputs(tokens)
        times = {}
        with torch.inference_mode():
            for name, m in (("bf16", plain), ("int4", mod)):
                for _ in range(3):
                    m(x, ids, w)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    m(x, ids, w)
                end.record()
                torch.cuda.synchronize()
                times[name] = start.elapsed_time(end) / 20
        print(f"INT4_EXPERTS tokens={tokens} bf16 {times['bf16']:.3f} ms  int4 {times['int4']:.3f} ms  "
              f"({times['bf16'] / times['int4']:.2f}x)")


def test_engine_int4_experts_greedy_equals_bf16_on_dequantized_weights(tmp_path: Path) -> None:
    import base64

    import numpy as np
    from safetensors.torch import load_file, save_file
    from test_engine_gpu_paths import PROMPTS, _assert_same_or_tie, _engine, _run

    from milepost.lowprec.contract import Contract
    from milepost.lowprec.experts_int4 import Int4StackedExperts
    from milepost.lowprec.quantize import dequantize, quantize
    from milepost.testing.checkpoints import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "src", "qwen3_moe")
    sd = load_file(src / "model.safetensors")
    int4 = Contract("int4", "int4")
    deq = tmp_path / "deq"
    deq.mkdir()
    save_file({n: dequantize(quantize(t.bfloat16(), "int4")) if int4.tensor_format(n, "rollout") == "int4"
               else t for n, t in sd.items()}, deq / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, deq / f.name)
    res = {}
    for run, path, quant in (("int4", src, "int4"), ("ref", deq, None)):
        engine = _engine(path, "bfloat16", True, quantization=quant)
        try:
            res[run] = _run(engine, PROMPTS, 16, 0.0)
            model = engine.runner.model
            if run == "int4":
                assert isinstance(model.model.layers[0].mlp.experts, Int4StackedExperts)
                assert engine.runner.graphs is not None, "decode CUDA graphs are off"
                layers, top_k = model.num_layers, model.moe_top_k
            else:
                ref_model = model
        finally:
            engine.close()
    for ids, out in zip(PROMPTS, res["int4"]):
        routed = np.frombuffer(base64.b64decode(out["routed"]), dtype=np.int32)
        assert routed.reshape(len(ids) + len(out["ids"]) - 1, layers, top_k).min() >= 0
    _assert_same_or_tie(ref_model, PROMPTS, [o["ids"] for o in res["int4"]],
                        [o["ids"] for o in res["ref"]], 0.05, relative=True)
