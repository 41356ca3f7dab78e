"""What the fused INT4 MoE kernels' unit tests share (tests/unit/test_fused_moe_int4.py and its
zero-point twin): small INT4 experts packed by the engine's store with group scales spread over six
orders of magnitude along H, a routing that crowds one expert, and the comparison of the fused
INT4 kernels with the bf16 fused kernel on the dequantized weights (without CUDA both run under
Triton's interpreter in fp32: the caller sets TRITON_INTERPRET before importing Triton)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from milepost.kernels.fused_moe import MoeConfig
    from milepost.lowprec.experts_int4 import Int4StackedExperts


def small_int4_experts(e: int, h: int, i: int) -> Int4StackedExperts:
    """CPU StackedExperts(e, h, i) packed to INT4 (symmetric, no zero points): w13 N(0, 0.02)
    scaled by logspace(-3, 3) along H (a scale read from the wrong group or row shows), w2
    N(0, 0.2); seed 0."""
    from milepost.lowprec.experts_int4 import Int4StackedExperts, _pack
    from milepost.models.qwen3_moe import StackedExperts

    g = torch.Generator().manual_seed(0)
    mod = StackedExperts(e, h, i)
    with torch.no_grad():
        mod.w13.copy_(torch.randn(mod.w13.shape, generator=g) * torch.logspace(-3, 3, h)[None, None] * 0.02)
        mod.w2.copy_(torch.randn(mod.w2.shape, generator=g) * 0.2)
        _pack(mod)
    assert isinstance(mod, Int4StackedExperts)
    return mod


def crowded_routing(t: int, e: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 tokens [t, h], top-3 expert ids [t, 3] and weights [t, 3]; the first half of the
    tokens all go to experts 4, 0 and 5 (one expert with more rows than others; e >= 6)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:3] for _ in range(t)])
    ids[: t // 2, 0] = 4  # one expert with more rows than others
    ids[: t // 2, 1:] = torch.tensor([0, 5])
    return torch.randn(t, h, generator=g), ids, torch.rand(t, 3, generator=g)


def assert_fused_int4_is_the_bf16_kernel(experts: Int4StackedExperts, x: torch.Tensor, ids: torch.Tensor,
                                         w: torch.Tensor, cfg: MoeConfig, dev: str) -> torch.Tensor:
    """The fused INT4 kernels on `dev` (with the experts' zero points, if any) against the bf16
    fused kernel on the float32 dequantized weights with the same config: bit for bit on the CPU
    (the interpreter, fp32: the same tiles on the same products), within tf32's rounding on a
    GPU; and within fp32 rounding of the module's per-expert loop, per row's own scale. Returns
    the fused output (on the CPU)."""
    from milepost.kernels import fused_moe as fm
    from milepost.kernels import fused_moe_int4 as f4
    from milepost.lowprec.experts_int4 import dequantize_packed

    h, i = x.shape[1], experts.intermediate
    w13 = dequantize_packed(experts.w13, experts.w13_scale, h, torch.float32, experts.w13_zero)
    w2 = dequantize_packed(experts.w2, experts.w2_scale, i, torch.float32, experts.w2_zero)
    xs = [t.to(dev) for t in (x, ids, w)]
    args = [a.detach().to(dev) for a in (experts.w13, experts.w13_scale, experts.w2, experts.w2_scale)]
    zeros = [z.to(dev) if z is not None else None for z in (experts.w13_zero, experts.w2_zero)]
    got = f4.fused_expert_mlp_int4(*xs, *args, cfg, *zeros).cpu()
    want = fm.fused_expert_mlp(*xs, w13.to(dev), w2.to(dev), cfg).cpu()
    if dev == "cpu":
        assert torch.equal(got, want)
    else:  # fp32 tl.dot runs in tf32 on a GPU
        torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-4)
    with torch.no_grad():
        ref = experts(x, ids, w)  # CPU: the per-expert loop on the dequantized weights
    tol = (1e-5 if dev == "cpu" else 5e-3) * ref.abs().amax(1, keepdim=True)  # rows' own scale
    assert ((got - ref).abs() <= tol).all()
    return got
