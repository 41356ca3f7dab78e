"""FP8-dynamic checkpoints (per-channel FP8 weights, per-token FP8 activations) on Hopper:
`torch._scaled_mm` rowwise passes its start-up probe and agrees with the emulated product
(kernels/fp8_rowwise.py); the quantizer's bits on CUDA equal the CPU's; an engine serving such a
checkpoint runs W8A8 with its linears on the native GEMM, each call within the GEMM's own
semantics (exact products, float32 scaling) of the same input. Run on the accelerator machine:
`python -m pytest -q -m gpu tests/gpu/test_fp8_rowwise_cuda.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.weight_fp8 import Fp8Linear
from milepost.kernels.fp8_rowwise import (
    emulated_rowwise_linear,
    rowwise_backend,
    rowwise_linear,
    rowwise_takes,
)
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


def _exact_rowwise(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, tolerance): the rowwise GEMM's own semantics written out (per-token FP8 values times
    the FP8 weight, every product exact, summed in float64, scaled by sx * sw in float32, no
    bf16 rounding) and the bound a correct native result keeps: the bf16 output rounding (at
    most 2^-8 |y|, 8 significant bits; doubled) plus the tensor cores' FP8 accumulation error,
    bounded by 2^-10 of the sum of the products' magnitudes (Hopper keeps fewer accumulator
    bits than float32)."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_fp8_per_token(x2)
    scale = sx * sw.float().reshape(1, -1)
    y = (xq.double() @ w.double().t()).float() * scale
    mags = (xq.double().abs() @ w.double().abs().t()).float() * scale
    if bias is not None:
        y = y + bias.float()
    return y, 2.0**-7 * y.abs() + 2.0**-10 * mags + 1e-30


def test_fp8_dynamic_engine_runs_w8a8_natively(tmp_path: Path) -> None:
    """Each Fp8Linear of an engine serving an FP8-dynamic checkpoint runs the native rowwise
    GEMM, checked call by call (prefill and eager decode; CUDA graph captures skipped) against
    the GEMM's semantics on the same input. The end-to-end log-probs are not compared with a
    tight bound: on this tiny model (random FP8 codes over the whole E4M3 range) one bf16 ulp
    anywhere moves the first token's log-prob by up to 0.18 (CPU measurement: the exact-product
    linears with 2^-14 relative noise added to the accumulator; the emulated linears, which
    round their operands to bf16, differ by 0.08 / 0.03 / 0.12 on the three prompts), because
    the next layer's per-token re-quantization turns it into whole FP8 steps. The per-call bound
    (on CPU: float32-accumulated products rounded to bf16 reach 0.40 of it, the emulated linears
    1.8x, a reversed weight-scale vector 9000x, token scales one row off 1200x) is what tells a wrong scale layout."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("rowwise FP8 GEMM needs compute capability 9.0+")
    src = make_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=3, with_tokenizer=False,
                               hidden_size=256, intermediate_size=512, head_dim=64,
                               num_attention_heads=4, num_key_value_heads=2)
    write_fp8(src, tmp_path / "pc", "channel")

    def engine(**kw: object) -> object:
        return build_engine(ServerArgs(model_path=tmp_path / "pc", device="cuda", dtype="bfloat16",
                                       page_size=16, max_total_tokens=4096, **kw).resolved())[0]

    a = engine()
    lin = [m for m in a.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert lin and all(m.act_per_token and rowwise_takes(m.weight) for m in lin)
    assert rowwise_backend(CUDA) == "scaled_mm", "the rowwise FP8 GEMM failed its probe (see the log)"
    worst: list[float] = []

    def checked(mod: Fp8Linear) -> object:
        native = mod.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            y = native(x)
            if not torch.cuda.is_current_stream_capturing():
                ref, tol = _exact_rowwise(x, mod.weight, mod.weight_scale, mod.bias)
                worst.append(((y.reshape(ref.shape).float() - ref).abs() / tol).max().item())
            return y
        return forward

    for m in lin:
        m.forward = checked(m)  # type: ignore[method-assign]
    prompts = random_prompts((9, 5, 30), seed=7)
    tokens, logps = greedy_outputs(a, prompts, 8)
    assert len(worst) >= len(lin) and max(worst) <= 1.0, (len(worst), max(worst))
    del a
    torch.cuda.empty_cache()
    b = engine()
    for m in b.runner.model.modules():  # the emulated definition, same stored weights
        if isinstance(m, Fp8Linear):
            m.forward = (lambda mod: lambda x: emulated_rowwise_linear(x, mod.weight, mod.weight_scale, mod.bias))(m)  # type: ignore[method-assign]
    ref_tokens, ref_logps = greedy_outputs(b, prompts, 8)
    assert tokens[0][0] == ref_tokens[0][0]
    print("linear calls checked:", len(worst), "worst error / bound:", max(worst),
          "first-token logprob diff native vs emulated:", [abs(p[0] - q[0]) for p, q in zip(logps, ref_logps)])
