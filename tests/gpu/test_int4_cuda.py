"""Packed INT4 on CUDA: the W4A16 kernel (milepost/kernels/int4_gemm.py) passes its probe and gives
the product of the dequantized weights in bf16, fp16 and fp32 at the Qwen3 projection shapes and
decode M, reproducibly and inside a CUDA graph; the prefill path's Triton dequantization gives
torch's bits; an INT4 engine holds packed weights on the GPU,
dequantizing to the CPU's values, and decodes close to the torch path.
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_int4_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from milepost.lowprec.quantize import dequantize, quantize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),  # qwen3-0.6b qkv, o, gate_up, down
          (6144, 2560), (2560, 9728)]  # qwen3-4b qkv, down


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02 * torch.logspace(-2, 2, k)[None, :]
    q = quantize(w, "int4")
    return q.values.cuda(), q.scales.cuda(), dequantize(q)


def test_the_kernel_passes_its_probe() -> None:
    from milepost.kernels.int4_gemm import kernel_ok

    assert kernel_ok(torch.device("cuda"))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w4a16_equals_the_dequantized_product(n: int, k: int, dtype: torch.dtype) -> None:
    from milepost.kernels.int4_gemm import dequantize_int4, w4a16_mm

    packed, scales, deq = _weights(n, k)
    assert torch.equal(dequantize_int4(packed, scales, k, torch.float32).cpu(), deq)  # CPU bits
    w = deq.to(dtype).float().cuda()  # the values the kernel multiplies: rounded once to dtype
    for m in (1, 8, 33, 64, 256):
        x = torch.randn(m, k, device="cuda").to(dtype)
        ref = x.float() @ w.t()
        y = w4a16_mm(x, packed, scales, k)
        assert y.dtype == dtype
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
        assert ((y.float() - ref).abs() <= tol * ref.abs().amax(1, keepdim=True)).all(), m
        assert torch.equal(y, w4a16_mm(x, packed, scales, k))  # reproducible: no atomics


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_dequantization_gives_torchs_bits(dtype: torch.dtype) -> None:
    """The prefill path's weight: the same bits as torch's dequantization (bf16 rounded to
    nearest even on the GPU; the interpreter cannot check that)."""
    from milepost.kernels.int4_gemm import dequantize_int4, dequantize_int4_triton

    packed, scales, deq = _weights(1000, 1100)
    got = dequantize_int4_triton(packed, scales, 1100, dtype)
    assert torch.equal(got, dequantize_int4(packed, scales, 1100, dtype))
    assert torch.equal(got.cpu(), deq.to(dtype))


def test_prefill_m_takes_the_dequantization_and_cublas() -> None:
    from milepost.kernels.int4_gemm import dequantize_int4, int4_linear

    packed, scales, _ = _weights(1024, 2048)
    x = torch.randn(1000, 2048, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(int4_linear(x, packed, scales, 2048),
                       F.linear(x, dequantize_int4(packed, scales, 2048, torch.bfloat16)))


def test_int4_linear_in_a_cuda_graph() -> None:
    from milepost.kernels.int4_gemm import int4_linear

    packed, scales, _ = _weights(6144, 1024)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    want = int4_linear(x, packed, scales, 1024)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_linear(x, packed, scales, 1024)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_int4_engine_holds_packed_weights_and_decodes_as_the_torch_path(tmp_path: Path,
                                                                        monkeypatch) -> None:
    """Packed weights on the GPU with the CPU's values; greedy tokens through the W4A16 kernel in
    the decode CUDA graphs equal the same engine's with the kernel off (unpack + F.linear) or
    part at a near-tie (the two sum in another order)."""
    from safetensors.torch import load_file
    from test_engine_gpu_paths import PROMPTS, _assert_same_or_tie, _engine, _run

    from milepost.kernels import int4_gemm
    from milepost.testing.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path, "qwen3", seed=0, with_tokenizer=False,
                                hidden_size=256, intermediate_size=640, head_dim=64)
    up = "model.layers.0.mlp.up_proj.weight"
    sent = load_file(ckpt / "model.safetensors")[up].to(torch.bfloat16).float()
    res = {}
    for run in ("kernel", "torch"):
        if run == "torch":
            monkeypatch.setattr(int4_gemm, "kernel_ok", lambda device: False)
        engine = _engine(tmp_path, "bfloat16", True, quantization="int4")
        try:
            res[run] = _run(engine, PROMPTS, 16, 0.0)
            model = engine.runner.model
            if run == "kernel":
                view = model.weight_view(up)
                assert view.is_cuda and view.dtype == torch.uint8
                assert model.fp8_weights.hf_shape(view) == (640, 256)
                got = model.fp8_weights.dequantized(view)[0].cpu()
                assert torch.equal(got, dequantize(quantize(sent, "int4")))  # the CPU's values
                assert engine.runner.graphs is not None, "decode CUDA graphs are off"
                lin = model.model.layers[0].mlp.gate_up_proj
                x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
                w = int4_gemm.dequantize_int4(lin.weight, lin.weight_scale, 256, torch.bfloat16)
                assert torch.allclose(lin(x).float(), F.linear(x, w).float(), rtol=2e-2, atol=1e-3)
            ref_model = model
        finally:
            engine.close()
    assert all(len(o["ids"]) == 16 for o in res["kernel"])
    _assert_same_or_tie(ref_model, PROMPTS, [o["ids"] for o in res["kernel"]],
                        [o["ids"] for o in res["torch"]], 0.05, relative=True)
