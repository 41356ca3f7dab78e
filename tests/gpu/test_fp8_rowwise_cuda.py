"""FP8-dynamic checkpoints (per-channel FP8 weights, per-token FP8 activations) on Hopper:
`torch._scaled_mm` rowwise passes its start-up probe and agrees with the emulated product
(kernels/fp8_rowwise.py); the quantizer's bits on CUDA equal the CPU's; an engine serving such a
checkpoint runs W8A8 with its linears on the native GEMM and decodes close to the emulated
definition. Run on the accelerator machine:
`python -m pytest -q -m gpu tests/gpu/test_fp8_rowwise_cuda.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.weight_fp8 import Fp8Linear
from milepost.kernels.fp8_rowwise import emulated_rowwise_linear, rowwise_backend, rowwise_linear
from milepost.lowprec.quantize import quantize_fp8_per_token
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts
from milepost.testing.quant_checkpoints import write_fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def test_per_token_quantizer_bits_equal_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1000, generator=g) * torch.logspace(-8, 8, 64)[:, None]
    x[3] = 0.0
    x[5, 9] = float("nan")
    for t in (x, x.bfloat16()):
        v_cpu, s_cpu = quantize_fp8_per_token(t)
        v_gpu, s_gpu = quantize_fp8_per_token(t.to(CUDA))
        assert torch.equal(v_gpu.view(torch.uint8).cpu(), v_cpu.view(torch.uint8))
        assert torch.equal(s_gpu.cpu().nan_to_num(-1.0), s_cpu.nan_to_num(-1.0))


def test_scaled_mm_rowwise_passes_the_probe_and_agrees_with_emulation() -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("rowwise FP8 GEMM needs compute capability 9.0+")
    assert rowwise_backend(CUDA) == "scaled_mm", "the rowwise FP8 GEMM failed its probe (see the log)"
    g = torch.Generator(device=CUDA).manual_seed(2)
    for m in (1, 7, 128, 1000):
        x = torch.randn(m, 1024, device=CUDA, generator=g).bfloat16()
        w = (torch.randn(768, 1024, device=CUDA, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
        sw = torch.rand(768, device=CUDA, generator=g) * 1e-3
        y = rowwise_linear(x, w, sw).float()
        ref = emulated_rowwise_linear(x.float(), w, sw)  # float32 GEMM of the same values
        tol = 1e-2 * ref.abs() + 1e-2 * ref.abs().amax(1, keepdim=True)
        assert ((y - ref).abs() <= tol).all(), (m, (y - ref).abs().max().item())


def test_fp8_dynamic_engine_runs_w8a8_natively(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=3, with_tokenizer=False,
                               hidden_size=256, intermediate_size=512, head_dim=64,
                               num_attention_heads=4, num_key_value_heads=2)
    write_fp8(src, tmp_path / "pc", "channel")

    def engine(**kw: object) -> object:
        return build_engine(ServerArgs(model_path=tmp_path / "pc", device="cuda", dtype="bfloat16",
                                       page_size=16, max_total_tokens=4096, **kw).resolved())[0]

    a = engine()
    lin = [m for m in a.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert lin and all(m.act_per_token for m in lin)
    prompts = random_prompts((9, 5, 30), seed=7)
    tokens, logps = greedy_outputs(a, prompts, 8)
    del a
    torch.cuda.empty_cache()
    b = engine()
    for m in b.runner.model.modules():  # the emulated definition, same stored weights
        if isinstance(m, Fp8Linear):
            m.forward = (lambda mod: lambda x: emulated_rowwise_linear(x, mod.weight, mod.weight_scale, mod.bias))(m)  # type: ignore[method-assign]
    ref_tokens, ref_logps = greedy_outputs(b, prompts, 8)
    # Accumulation order differs (native vs bf16 emulated): the first token's log-prob within bf16 noise.
    assert tokens[0][0] == ref_tokens[0][0]
    assert max(abs(p - q) for p, q in zip(logps[0][:1], ref_logps[0][:1])) < 0.05
    print("first-token logprob diff native vs emulated:",
          [abs(p[0] - q[0]) for p, q in zip(logps, ref_logps)])
