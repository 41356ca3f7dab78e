"""FP8 activations made inside the norm and SiLU kernels on CUDA (milepost/kernels/fused_fp8_act.py,
issue 23): the bytes and scales of the bf16 kernel then `quantize_act_1x128(y, 4)` at the Qwen3
shapes, the same product from every FP8 GEMM the probe kept, and an fp8_block engine (decode in
CUDA graphs) whose greedy tokens and log-probs are the same with the fusion on and off.
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_fused_fp8_act_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROWS = (1, 7, 64, 256, 300)


def _x(t: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-3, 3, t)[:, None]
    return (x * torch.logspace(-1, 1, k)[None, :]).to(torch.bfloat16).cuda()


def _same_bits(a, y: torch.Tensor) -> None:
    from milepost.kernels.fp8_quant import quantize_act_1x128

    q, s = quantize_act_1x128(y, 4)
    assert a.rows == y.shape[0] and a.scales.stride() == s.stride()
    assert torch.equal(a.values.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(a.scales.view(torch.int32), s.view(torch.int32))


@pytest.mark.parametrize("k", [1024, 2560])  # Qwen3-0.6B / 4B hidden
@pytest.mark.parametrize("t", ROWS)
def test_norms_give_the_unfused_bits(t: int, k: int) -> None:
    from milepost.kernels import fused_ops
    from milepost.kernels.fused_fp8_act import add_rms_norm_fp8, rms_norm_fp8

    x, r = _x(t, k, 0), _x(t, k, 1).flip(0)
    w = torch.logspace(-1, 1, k).to(torch.bfloat16).cuda()
    _same_bits(rms_norm_fp8(x, w, 1e-6), fused_ops.rms_norm(x, w, 1e-6))
    h, a = add_rms_norm_fp8(x, r, w, 1e-6)
    h_ref, y_ref = fused_ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, h_ref)
    _same_bits(a, y_ref)


@pytest.mark.parametrize("groups", [1, 2, 4, 8, 32])
@pytest.mark.parametrize("k", [1024, 2560, 4096])
def test_norms_split_over_programs_give_the_unfused_bits(monkeypatch: pytest.MonkeyPatch, k: int,
                                                         groups: int) -> None:
    """Any blocks a program (a row split over programs, each redoing the row's reduction in
    fused_ops' layout) gives the unfused bits on the GPU, where layouts decide the sum's order."""
    from milepost.kernels import fused_fp8_act, fused_ops

    monkeypatch.setattr(fused_fp8_act, "GROUPS_PER_PROGRAM", groups)
    for t in (64, 256):
        x, r = _x(t, k, 5), _x(t, k, 6).flip(0)
        w = torch.logspace(1, -1, k).to(torch.bfloat16).cuda()
        _same_bits(fused_fp8_act.rms_norm_fp8(x, w, 1e-5), fused_ops.rms_norm(x, w, 1e-5))
        h, a = fused_fp8_act.add_rms_norm_fp8(x, r, w, 1e-5)
        h_ref, y_ref = fused_ops.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(h, h_ref)
        _same_bits(a, y_ref)


@pytest.mark.parametrize("k", [2048, 4096])  # o_proj's input, Qwen3-0.6B / 4B
@pytest.mark.parametrize("t", ROWS)
def test_quantize_rows_gives_quantize_act_bits(t: int, k: int) -> None:
    from milepost.kernels.fused_fp8_act import quantize_rows_fp8

    x = _x(t, k, 7)
    _same_bits(quantize_rows_fp8(x), x)


@pytest.mark.parametrize("n", [3072, 9728])  # Qwen3-0.6B / 4B intermediate
@pytest.mark.parametrize("t", ROWS)
def test_silu_mul_gives_the_unfused_bits(t: int, n: int) -> None:
    from milepost.kernels import fused_ops
    from milepost.kernels.fused_fp8_act import silu_mul_fp8

    gate, up = torch.cat([_x(t, n, 2) * 1e-2, _x(t, n, 3)], dim=1).chunk(2, dim=-1)
    _same_bits(silu_mul_fp8(gate, up), fused_ops.silu_mul(gate, up))


@pytest.mark.parametrize("t", ROWS)
def test_every_probed_gemm_gives_the_same_product_from_the_fp8_act(t: int) -> None:
    from milepost.kernels import fp8_gemm
    from milepost.kernels.fused_fp8_act import rms_norm_fp8
    from milepost.kernels.fused_ops import rms_norm
    from milepost.lowprec.quantize import quantize

    dev = torch.device("cuda", torch.cuda.current_device())
    fp8_gemm.block_backend(dev)
    kept = {fp8_gemm._BACKEND[dev.index], *fp8_gemm._SMALL[dev.index].values()} - {"emulated"}
    assert kept, "no native FP8 GEMM passed the probe here"
    x, w = _x(t, 2560, 4), torch.logspace(-1, 1, 2560).to(torch.bfloat16).cuda()
    q = quantize(torch.randn(6144, 2560, device=dev) * 0.02, "fp8_block")
    a, y = rms_norm_fp8(x, w, 1e-6), rms_norm(x, w, 1e-6)
    for backend in sorted(kept):
        got = fp8_gemm.fp8_act_linear(a, q.values, q.scales, backend)
        assert torch.equal(got, fp8_gemm.fp8_block_linear(y, q.values, q.scales, backend)), backend


@pytest.mark.parametrize("ticket", [None, True])
def test_engine_greedy_is_the_same_with_the_fusion_on_and_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              ticket: bool | None) -> None:
    """ticket True: the decode GEMMs split K in two (the tiny shapes split nothing by the rule)
    and sum the parts by ticket (fp8_decode.TICKET)."""
    from milepost.engine.server_args import ServerArgs
    from milepost.engine.setup import build_engine
    from milepost.kernels import fp8_decode, fp8_gemm
    from milepost.lowprec.engine_store import QuantizedLinear
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.engine_greedy import greedy_outputs, random_prompts

    monkeypatch.setattr(fp8_decode, "TICKET", ticket)
    if ticket:
        rule = fp8_decode.decode_config
        monkeypatch.setattr(fp8_decode, "decode_config", lambda *a: rule(*a)._replace(split=2))
    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False,
                                hidden_size=256, intermediate_size=512, head_dim=64,
                                num_attention_heads=4, num_key_value_heads=2)
    calls = {"n": 0}
    act_linear = fp8_gemm.fp8_act_linear

    def counted(*a, **kw):
        calls["n"] += 1
        return act_linear(*a, **kw)

    monkeypatch.setattr(fp8_gemm, "fp8_act_linear", counted)
    out, seen = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(QuantizedLinear, "fuse_act_quant", fused)
        calls["n"] = 0
        args = ServerArgs(model_path=ckpt, device="cuda", dtype="bfloat16", page_size=16,
                          max_total_tokens=4096, quantization="fp8_block").resolved()
        engine = build_engine(args)[0]
        try:
            assert any(m.native for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear))
            out[fused] = greedy_outputs(engine, random_prompts((37, 5, 130), seed=7), 16)
        finally:
            engine.close()
        seen[fused] = calls["n"]
        del engine
        torch.cuda.empty_cache()
    assert seen[False] == 0 and seen[True] > 0
    assert out[True] == out[False]
