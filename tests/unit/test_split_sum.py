"""Split FP8 GEMM outputs left unsummed for the fused residual add + RMSNorm (lowprec/fp8_act.py
SplitSum): the norm kernel sums the parts itself with the second kernel's bits, the decode GEMM
hands its parts back only where asked, and an fp8_block engine (native FP8 linears forced on the
CPU, the kernels under Triton's interpreter) decodes the same greedy tokens and log-probs with
the parts left unsummed as with every sum its own launch.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from milepost.kernels import fp8_decode, fp8_gemm  # noqa: E402
from milepost.kernels.fused_fp8_act import add_rms_norm_fp8, rms_norm_fp8  # noqa: E402
from milepost.lowprec.fp8_act import SplitSum, summed  # noqa: E402
from milepost.lowprec.quantize import quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter multiplies bf16 tiles wrongly; the kernels are the same code for fp16
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16
torch.set_num_threads(1)


def _equal(a, b) -> bool:
    return torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8)) and torch.equal(
        a.scales, b.scales) and a.rows == b.rows


@pytest.mark.parametrize("dtype,split,rows", [(HALF, 2, 5), (HALF, 3, 64), (torch.float32, 4, 3)])
def test_norm_sums_the_parts_to_the_second_kernels_bits(dtype: torch.dtype, split: int,
                                                        rows: int) -> None:
    """Parts of very different sizes (the order of the fp32 sums shows), an Inf and a NaN."""
    g = torch.Generator().manual_seed(split)
    k = 384
    x = torch.randn(rows, k, generator=g).to(dtype).to(DEV)
    parts = torch.randn(split, rows, k, generator=g) * torch.logspace(-3, 4, split)[:, None, None]
    parts[0, 0, 5], parts[-1, rows - 1, 7] = float("inf"), float("nan")
    r = SplitSum(parts.to(DEV), dtype)
    w = torch.logspace(-1, 1, k).to(dtype).to(DEV)
    h, a = add_rms_norm_fp8(x, r, w, 1e-6)
    h_ref, a_ref = add_rms_norm_fp8(x, r.summed(), w, 1e-6)
    assert torch.equal(h.nan_to_num(), h_ref.nan_to_num()) and torch.equal(h.isnan(), h_ref.isnan())
    assert torch.equal(a.scales.isnan(), a_ref.scales.isnan())
    assert _equal(a._replace(scales=a.scales.nan_to_num()), a_ref._replace(scales=a_ref.scales.nan_to_num()))
    assert summed(h) is h and torch.equal(summed(r).nan_to_num(), r.summed().nan_to_num())


def test_parts_that_do_not_make_the_rows_are_refused() -> None:
    x = torch.randn(4, 256, device=DEV)
    w = torch.ones(256, device=DEV)
    with pytest.raises(ValueError, match="split parts"):
        add_rms_norm_fp8(x, SplitSum(torch.zeros(2, 3, 256, device=DEV), torch.float32), w, 1e-6)
    with pytest.raises(ValueError, match="split parts"):
        add_rms_norm_fp8(x, SplitSum(torch.zeros(2, 4, 256, device=DEV), HALF), w, 1e-6)


@pytest.mark.parametrize("cache", [HALF, torch.float8_e4m3fn])
def test_rope_store_sums_the_parts_to_the_second_kernels_bits(cache: torch.dtype) -> None:
    """q out and the K/V rows stored (an fp8 pool saturates them) equal from the parts as from
    their sum; a padding slot (-1) stores nothing."""
    from milepost.kernels.paged_attention import rope_store

    g = torch.Generator().manual_seed(4)
    t, h, hkv, d = 5, 4, 2, 64
    parts = torch.randn(3, t, (h + 2 * hkv) * d, generator=g) * torch.tensor([1e-3, 30.0, 1.0])[:, None, None]
    r = SplitSum(parts.to(DEV), HALF)
    cos, sin = (f(torch.randn(t, d, generator=g)).to(HALF).to(DEV) for f in (torch.cos, torch.sin))
    qw, kw = (torch.rand(d, generator=g).to(HALF).to(DEV) for _ in range(2))
    slots = torch.tensor([3, 0, -1, 7, 5], device=DEV)
    got, want = [], []
    for qkv, res in ((r, got), (r.summed(), want)):
        kc = torch.zeros(8, hkv, d, device=DEV).to(cache)
        vc = torch.zeros(8, hkv, d, device=DEV).to(cache)
        res += [rope_store(qkv, h, hkv, qw, kw, 1e-6, cos, sin, kc, vc, slots), kc, vc]
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_decode_gemm_hands_back_its_parts_only_when_split_and_asked(monkeypatch) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 512, generator=g).to(HALF).to(DEV)
    q = quantize(torch.randn(256, 512, generator=g), "fp8_block")
    wv, ws = q.values.to(DEV), q.scales.to(DEV)
    rule = fp8_decode.decode_config
    for split in (1, 2, 4):
        monkeypatch.setattr(fp8_decode, "decode_config",
                            lambda *a, s=split: rule(*a)._replace(split=s, ticket=False))
        want = fp8_gemm.fp8_block_linear(x, wv, ws, "decode")
        got = fp8_gemm.fp8_block_linear(x, wv, ws, "decode", unsummed=True)
        act = fp8_gemm.fp8_act_linear(rms_norm_fp8(x, torch.ones(512, dtype=HALF, device=DEV), 1e-6),
                                      wv, ws, "decode", unsummed=True)
        assert isinstance(got, SplitSum) == (split > 1) == isinstance(act, SplitSum)
        assert torch.equal(summed(got), want)
        if split > 1:
            assert got.parts.shape == (split, 6, 256) and got.dtype == HALF
    assert isinstance(fp8_gemm.fp8_block_linear(x, wv, ws, "emulated", unsummed=True), torch.Tensor)


@pytest.mark.skipif(DEV == "cuda", reason="CPU forcing of the native path (tests/gpu runs the real one)")
def test_engine_decodes_the_same_with_parts_left_unsummed(tmp_path, monkeypatch) -> None:
    """Greedy tokens and log-probs of an fp8_block engine whose projections' GEMMs are split in
    two (each K: two 128-blocks) equal with QuantizedLinear.leave_split_parts on and off; with
    it on (and fp8_act.PARTS_TO_NORM), o_proj's and down_proj's parts reach the fused add +
    norm unsummed (qkv_proj's go to the Triton attention's RoPE + store kernel, which the CPU
    engine does not run: tests/gpu/test_split_sum_cuda.py)."""
    from milepost.engine.server_args import ServerArgs
    from milepost.lowprec import engine_store, fp8_act
    from milepost.lowprec.engine_store import QuantizedLinear
    from milepost.models import layers
    from milepost.testing.checkpoints import make_tiny_checkpoint
    from milepost.testing.engine_greedy import fresh_engine_greedy, random_prompts

    ckpt = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3, with_tokenizer=False,
                                hidden_size=256, intermediate_size=256, head_dim=64,
                                num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(engine_store, "_native", lambda m, fmt, parts: fmt == "fp8_block" and all(
        r % 128 == 0 and n % 128 == 0 for r, n, _ in parts))
    monkeypatch.setattr(fp8_gemm, "block_backend", lambda dev, m=None: "decode")
    monkeypatch.setattr(layers, "gpu_inference", lambda x: True)
    rule = fp8_decode.decode_config
    monkeypatch.setattr(fp8_decode, "decode_config", lambda *a: rule(*a)._replace(split=2, ticket=False))
    monkeypatch.setattr(fp8_act, "PARTS_TO_NORM", True)
    left = []
    monkeypatch.setattr(fp8_decode, "SplitSum", lambda *a: left.append(1) or SplitSum(*a))
    out, counts = {}, {}
    for leave in (False, True):
        monkeypatch.setattr(QuantizedLinear, "leave_split_parts", leave)
        left.clear()
        args = ServerArgs(model_path=ckpt, device="cpu", dtype="float32", page_size=4,
                          quantization="fp8_block", cpu_kv_cache_gb=0.001).resolved()
        out[leave] = fresh_engine_greedy(args, random_prompts((7, 3), seed=1, high=500), 4)
        counts[leave] = len(left)
    assert out[True] == out[False] and len(out[True][0][0]) == 4
    # 4 forwards (a prefill, 3 decode steps) x 2 layers x (o_proj, down_proj)
    assert counts == {False: 0, True: 16}
