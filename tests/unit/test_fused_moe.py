"""The fused Triton MoE (kernels/fused_moe.py) against the per-expert loop of StackedExperts.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before importing
triton), in fp32: the interpreter's tl.dot on bf16 inputs returns garbage (triton 3.9), so bf16 is
checked on the GPU (tests/gpu/test_fused_moe_cuda.py).
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

from milepost.models.qwen3_moe import StackedExperts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(t: int, experts: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)]) if t else \
        torch.zeros(0, k, dtype=torch.int64)
    return ids.to(DEV), torch.rand(t, k, generator=g).to(DEV)


@pytest.mark.parametrize("hist,tokens", [(False, 23), (True, 23), (True, 600)])
def test_align_lays_out_each_experts_pairs_in_order_padded_to_blocks(hist: bool, tokens: int) -> None:
    """600 tokens x 2 slots: more pairs than one counting chunk (1024), the last one part-masked."""
    g = torch.Generator().manual_seed(1)
    experts, k, bm = 5, 2, 16
    ids, _ = _routing(tokens, experts, k, g)
    ids[:20, 0] = 3  # one expert over a block: two blocks, the second padded
    sorted_ids, block_expert, total = (a.cpu() for a in fm.align(ids, experts, bm, hist))
    flat = ids.reshape(-1).cpu()
    n, start = flat.numel(), 0
    for e in range(experts):
        pairs = (flat == e).nonzero()[:, 0].tolist()  # ascending: pair order
        padded = -(-len(pairs) // bm) * bm
        assert sorted_ids[start : start + len(pairs)].tolist() == pairs
        assert (sorted_ids[start + len(pairs) : start + padded] == n).all()  # the pad sentinel
        assert (block_expert[start // bm : (start + padded) // bm] == e).all()
        start += padded
    assert total.item() == start
    assert sorted_ids.numel() >= start and sorted_ids.numel() % bm == 0


@pytest.mark.parametrize("tokens,block_m,swap", [(1, 16, False), (7, 16, True), (33, 32, False)])
def test_fused_experts_match_the_expert_loop(tokens: int, block_m: int, swap: bool) -> None:
    """Uneven shapes: hidden 40 and intermediate 24 are not multiples of BLOCK_K or BLOCK_N (masks),
    6 experts is not a power of two; swap: the transposed MMA (weights on the M side)."""
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, k = 6, 40, 24, 3
    mod = StackedExperts(experts, hidden, inter)
    with torch.no_grad():
        mod.w13.copy_(torch.randn(mod.w13.shape, generator=g) * 0.2)
        mod.w2.copy_(torch.randn(mod.w2.shape, generator=g) * 0.2)
    mod = mod.to(DEV)
    x = torch.randn(tokens, hidden, generator=g).to(DEV)
    ids, w = _routing(tokens, experts, k, g)
    with torch.no_grad():
        ref = mod(x, ids, w)  # no_grad on CPU: the per-expert loop
    cfg = fm.MoeConfig(block_m, fm.GemmConfig(16, 16, swap_ab=swap), fm.GemmConfig(16, 16, swap_ab=swap),
                       hist_align=tokens > 1)
    got = fm.fused_expert_mlp(x, ids, w, mod.w13.detach(), mod.w2.detach(), cfg)
    tol = 1e-4 if DEV == "cpu" else 5e-3  # fp32 tl.dot runs in tf32 on a GPU
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol / 10)
    again = fm.fused_expert_mlp(x, ids, w, mod.w13.detach(), mod.w2.detach(), cfg)
    assert torch.equal(got, again)  # one program per output element, fixed order: reproducible


def test_no_tokens_and_the_measured_table() -> None:
    cfg = fm.MoeConfig(16, fm.GemmConfig(16, 16), fm.GemmConfig(16, 16))
    w13, w2 = torch.zeros(4, 32, 16, device=DEV), torch.zeros(4, 16, 16, device=DEV)
    out = fm.fused_expert_mlp(torch.zeros(0, 16, device=DEV), torch.zeros(0, 2, dtype=torch.int64, device=DEV),
                              torch.zeros(0, 2, device=DEV), w13, w2, cfg)
    assert out.shape == (0, 16)
    assert fm.config_for(8, 4, 16, 16, 2) is None  # an unmeasured shape keeps the grouped GEMMs
    table = {(4, 16, 16, 2): ((16, None), (256, cfg))}
    old, fm.MEASURED = fm.MEASURED, table
    try:
        assert fm.config_for(16, 4, 16, 16, 2) is None  # measured: grouped faster
        assert fm.config_for(17, 4, 16, 16, 2) is cfg and fm.config_for(256, 4, 16, 16, 2) is cfg
        assert fm.config_for(257, 4, 16, 16, 2) is None  # past the largest measured count
    finally:
        fm.MEASURED = old
