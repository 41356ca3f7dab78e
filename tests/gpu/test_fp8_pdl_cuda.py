"""Programmatic dependent launch through FP8 decode steps (fp8_quant.PDL) on CUDA: the decode
GEMM launched early (its weight rows prefetched into L2, then griddepcontrol.wait) gives the same
bits as launched plainly, after each kernel that triggers it, eagerly and replayed from a CUDA
graph; an fp8_block engine (decode in CUDA graphs, the decode GEMM forced) decodes the same greedy
tokens and log-probs with it on and off.
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_fp8_pdl_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _chain(x: torch.Tensor, r: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
           split: int) -> list[torch.Tensor]:
    """Each activation kernel followed by the decode GEMM reading its output."""
    from milepost.kernels import fp8_decode, fused_fp8_act

    cfg = fp8_decode.decode_config(x.shape[0], w.shape[0], w.shape[1], 132)._replace(split=split)
    norm_w = torch.ones(x.shape[1], dtype=x.dtype, device=x.device)
    acts = [fused_fp8_act.rms_norm_fp8(x, norm_w, 1e-6),
            fused_fp8_act.add_rms_norm_fp8(x, r, norm_w, 1e-6)[1],
            fused_fp8_act.silu_mul_fp8(gate, x),
            fused_fp8_act.quantize_rows_fp8(x)]
    return [fp8_decode.decode_block_mm_quantized(a.values, a.scales, a.rows, w, sw, torch.bfloat16, cfg)
            for a in acts]


@pytest.mark.parametrize("split,prefetch", [(1, True), (3, True), (1, False), (3, False)])
def test_early_launch_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch, split: int,
                                          prefetch: bool) -> None:
    from milepost.kernels import fp8_decode, fp8_quant

    monkeypatch.setattr(fp8_decode, "PDL_PREFETCH", prefetch)

    if not fp8_quant.pdl_supported(torch.device("cuda")):
        pytest.skip("needs grid dependency control (sm_90+ and a Triton that has it)")
    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 64, 1024, 768
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    r = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    gate = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    # within e4m3's range: a cast of a value past 448 gives NaN, and NaN != NaN
    w = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sw = torch.rand(n // 128, k // 128, device="cuda", generator=g) / 100
    monkeypatch.setattr(fp8_quant, "PDL", False)
    want = _chain(x, r, gate, w, sw, split)
    monkeypatch.setattr(fp8_quant, "PDL", True)
    eager = _chain(x, r, gate, w, sw, split)
    for a, b in zip(want, eager):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()
    _chain(x, r, gate, w, sw, split)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _chain(x, r, gate, w, sw, split)
    for _ in range(3):
        x.copy_(torch.randn(m, k, device="cuda", generator=g))
        monkeypatch.setattr(fp8_quant, "PDL", False)
        want = _chain(x, r, gate, w, sw, split)
        graph.replay()
        for a, b in zip(want, outs):
            assert torch.equal(a, b)


def test_engine_greedy_is_the_same_with_early_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from milepost.engine.server_args import ServerArgs
    from milepost.kernels import fp8_gemm, fp8_quant
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.engine_greedy import fresh_engine_greedy, random_prompts

    if not fp8_quant.pdl_supported(torch.device("cuda")):
        pytest.skip("needs grid dependency control (sm_90+ and a Triton that has it)")
    monkeypatch.setattr(fp8_gemm, "block_backend", lambda dev, m=None: "decode")
    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False,
                                hidden_size=256, intermediate_size=512, head_dim=64,
                                num_attention_heads=4, num_key_value_heads=2)
    out = {}
    for pdl in (False, True):
        monkeypatch.setattr(fp8_quant, "PDL", pdl)
        args = ServerArgs(model_path=ckpt, device="cuda", dtype="bfloat16", page_size=16,
                          max_total_tokens=4096, quantization="fp8_block").resolved()
        out[pdl] = fresh_engine_greedy(args, random_prompts((37, 5, 130), seed=7), 16)
    assert out[True] == out[False]
