"""The fused INT4 MoE kernels (kernels/fused_moe_int4.py) against the dequantize-then-bf16-kernel
path (fused_moe.fused_expert_mlp on the dequantized weights, the same config) and the INT4 experts'
own per-expert loop on the CPU.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before importing
triton), in fp32: its bf16 tl.dot is broken and its float32 -> bf16 cast truncates, so bf16 is
checked on the GPU (tests/gpu/test_fused_moe_int4_cuda.py). Hidden 201 and intermediate 136: odd,
not multiples of 128 (a partial group and a pad nibble on both GEMMs' K), nor of the tiles.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
fm = importlib.import_module("milepost.kernels.fused_moe")
f4 = importlib.import_module("milepost.kernels.fused_moe_int4")

from milepost.lowprec.experts_int4 import Int4StackedExperts
from milepost.testing.hopper_compile import needs_ptxas, run_compiled
from milepost.testing.int4_moe_interp import assert_fused_int4_is_the_bf16_kernel, crowded_routing, small_int4_experts

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I, K = 6, 201, 136, 3


@pytest.fixture(scope="module")
def experts() -> Int4StackedExperts:
    """INT4 experts packed by the engine's store; group scales spread over six orders of magnitude
    along H (a scale read from the wrong group or row shows)."""
    return small_int4_experts(E, H, I)


def _inputs(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return crowded_routing(t, E, H, seed)


def _args(mod: Int4StackedExperts) -> list[torch.Tensor]:
    return [a.detach().to(DEV) for a in (mod.w13, mod.w13_scale, mod.w2, mod.w2_scale)]


@pytest.mark.parametrize("tokens,cfg", [
    (1, fm.MoeConfig(16, fm.GemmConfig(32, 64, swap_ab=True), fm.GemmConfig(64, 32, swap_ab=True))),
    (7, fm.MoeConfig(16, fm.GemmConfig(64, 64), fm.GemmConfig(64, 128))),
], ids=["1-swap", "7-noswap"])
def test_fused_int4_equals_dequantize_then_the_bf16_kernel(experts: Int4StackedExperts, tokens: int,
                                                           cfg: fm.MoeConfig) -> None:
    """Bit for bit under the interpreter (fp32: the same tiles on the same products), and within
    fp32 rounding of the module's per-expert loop. BLOCK_K 32 and 64: a group over several K
    steps; the weight tile built transposed (swap) and not."""
    x, ids, w = _inputs(tokens, tokens)
    got = assert_fused_int4_is_the_bf16_kernel(experts, x, ids, w, cfg, DEV)
    if tokens > 1:  # the last pair on an expert its token does not use: only its row changes
        other = ids.clone()
        other[-1, -1] = next(e for e in range(E) if e not in ids[-1].tolist())
        moved = f4.fused_expert_mlp_int4(x.to(DEV), other.to(DEV), w.to(DEV), *_args(experts), cfg).cpu()
        assert not torch.allclose(moved[-1], got[-1], rtol=1e-3, atol=1e-4)
        assert torch.equal(moved[:-1], got[:-1])


def test_configs_fit_a_group_and_bad_operands_are_refused(experts: Int4StackedExperts,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for max_tokens, measured in f4.MEASURED_INT4[(128, 2048, 768, 8)]:  # the H200's, kept as measured
        assert f4.config_for(max_tokens, 128, 2048, 768, 8) == measured == f4._fit(measured)
    with monkeypatch.context() as m:  # a shape only the bf16 table lists: its tiles
        m.delitem(f4.MEASURED_INT4, (128, 2048, 768, 8))
        assert f4.config_for(1, 128, 2048, 768, 8).block_m == fm.config_for(1, 128, 2048, 768, 8).block_m
    big = fm.MoeConfig(16, fm.GemmConfig(64, 256), fm.GemmConfig(64, 96))
    fitted = f4._fit(big)
    assert fitted.gate_up.block_k == 128 and fitted.down.block_k == 128
    assert f4.config_for(10_000, E, H, I, K) == f4._fit(f4._DEFAULT[-1][1])  # unknown shape, past the table
    for t in (1, 16, 64, 128, 256):  # 64+ rows on each MMA's M side (the bf16 kernels' bits on Hopper)
        c = f4.config_for(t, 128, 2048, 768, 8)
        for g in (c.gate_up, c.down):
            assert (g.block_n if g.swap_ab else c.block_m) >= f4.MMA_M_MIN, (t, c.label())
    narrow = f4._fit(fm.MoeConfig(32, fm.GemmConfig(32, 128), fm.GemmConfig(64, 128, swap_ab=True)))
    assert narrow.gate_up.swap_ab and narrow.gate_up.block_n == 64 and narrow.down.block_n == 64
    assert f4._fit(fm.MoeConfig(64, fm.GemmConfig(32, 128), fm.GemmConfig(32, 128))).gate_up.swap_ab is False
    x, ids, w = _inputs(2, 0)
    with pytest.raises(ValueError, match="BLOCK_K dividing 128"):
        f4.fused_expert_mlp_int4(x.to(DEV), ids.to(DEV), w.to(DEV), *_args(experts), big)
    w13, s13, w2, s2 = _args(experts)
    with pytest.raises(ValueError, match="w13 .* not the packed INT4 store of hidden 200"):
        f4.fused_expert_mlp_int4(x[:, :200].to(DEV), ids.to(DEV), w.to(DEV), w13, s13, w2, s2, fitted)
    out = f4.fused_expert_mlp_int4(x[:0].to(DEV), ids[:0].to(DEV), w[:0].to(DEV), w13, s13, w2, s2, fitted)
    assert out.shape == (0, H)


# Compiled for the H100/H200 (sm_90) with Triton's bundled ptxas, no GPU needed: in a process of its
# own, since the interpreter (this module's mode without CUDA) patches triton.language globally.
_COMPILE = """
from milepost.testing.hopper_compile import fused_moe_mmas

for swap, kinds in ((True, ("gate_up", "down")), (False, ("gate_up",))):
    for kind in kinds:  # zero points: tests/unit/test_fused_moe_int4_zeros.py
        bf16, int4 = fused_moe_mmas(kind, swap, zero=False)
        assert bf16 and bf16 == int4, (kind, swap, bf16, int4)
    assert any(("wgmma" if swap else "mma.sync") in m for m in int4), int4
"""


@needs_ptxas()
def test_kernels_compile_for_hopper_to_the_bf16_kernels_mma_instructions() -> None:
    """The interpreter does not compile: this does (sm_90 cubins). Each INT4 kernel issues the
    bf16 kernel's MMA instructions (wgmma with the weight rows on the M side, mma.sync without),
    as many per tile: with the same weights in the same K order, the same sums on the GPU."""
    run_compiled(_COMPILE)
