"""What the INT4 MoE experts' CUDA tests share (tests/gpu/test_fused_moe_int4_cuda.py, its
zero-point twin and test_int4_experts_cuda.py): seeded INT4 experts packed by the engine's store
(optionally with random zero points), one forward checked against the fused kernels and an fp32
loop, and a decode forward replayed from a CUDA graph. Triton and the models import on first use,
so GPU test modules importing this still collect on a CPU machine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from milepost.testing.moe_reference import expert_loop, routed_inputs

if TYPE_CHECKING:
    from milepost.kernels.fused_moe import MoeConfig
    from milepost.models.qwen3_moe import StackedExperts


def packed_experts(e: int, h: int, i: int, zero_points: bool = False) -> StackedExperts:
    """CUDA bf16 StackedExperts(e, h, i) with N(0, 0.02) weights (seed 1), packed to INT4 by the
    store (which probes the kernels). `zero_points`: then random int8 zero points in -8..7 per
    expert, row and group (CUDA generator, seed 2), given through `put` as a checkpoint's arrive."""
    from milepost.lowprec.experts_int4 import _pack
    from milepost.lowprec.quantize import QTensor
    from milepost.models.qwen3_moe import StackedExperts

    torch.manual_seed(1)
    with torch.no_grad():
        mod = StackedExperts(e, h, i).cuda().bfloat16()
        mod.w13.normal_(0, 0.02)
        mod.w2.normal_(0, 0.02)
        _pack(mod)  # probes the kernels
        if not zero_points:
            return mod
        g = torch.Generator(device="cuda").manual_seed(2)
        for expert in range(e):
            for which in (0, 1, 2):
                q = mod.qtensor(expert, which)
                z = torch.randint(-8, 8, tuple(q.scales.shape), generator=g, device="cuda",
                                  dtype=torch.int8)
                mod.put(expert, which, QTensor("int4", q.values.clone(), q.scales.clone(), q.tile,
                                               q.shape, zeros=z))
        assert mod.w13_zero.any() and mod.w2_zero.any()
        return mod


@dataclass
class FusedRun:
    """One checked forward of `run_fused_int4`: the routed inputs, the config, the experts' output,
    the bf16 fused kernel's on the dequantized weights with that config, and the replaced path's."""

    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    cfg: MoeConfig
    got: torch.Tensor
    same_tiles: torch.Tensor
    old: torch.Tensor


def run_fused_int4(mod: StackedExperts, w13: torch.Tensor, w2: torch.Tensor, tokens: int, k: int,
                   ) -> FusedRun:
    """The INT4 experts' forward on `tokens` routed tokens (seed `tokens`), asserted to be the
    fused INT4 kernels' output on the module's nibbles, scales and zero points; it and the path it
    replaced (routed copies + bf16 experts at decode, every expert dequantized above) are within
    1e-2 of an fp32 loop on the dequantized weights w13 [E, 2I, H], w2 [E, H, I]. The bitwise
    comparison with the bf16 kernel (`same_tiles`) is left to the caller."""
    from milepost.kernels import fused_moe as fm
    from milepost.kernels import fused_moe_int4 as f4

    e, h, i = w2.shape[0], w2.shape[1], w2.shape[2]
    x, ids, w = routed_inputs(tokens, h, e, k, seed=tokens)
    cfg = f4.config_for(tokens, e, h, i, k)
    with torch.inference_mode():
        got = mod(x, ids, w)
        assert torch.equal(got, f4.fused_expert_mlp_int4(x, ids, w, mod.w13, mod.w13_scale, mod.w2,
                                                         mod.w2_scale, cfg, mod.w13_zero, mod.w2_zero))
        same_tiles = fm.fused_expert_mlp(x, ids, w, w13, w2, cfg)
        old = mod._routed_only(x, ids, w) if tokens * k < e else super(type(mod), mod).forward(x, ids, w)
        ref = expert_loop(x, ids, w, w13, w2)
        for y in (got, old):
            err = ((y.float() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (tokens, err)
    return FusedRun(x, ids, w, cfg, got, same_tiles, old)


def assert_replays_in_a_cuda_graph(mod: torch.nn.Module, h: int, e: int, k: int) -> None:
    """A 4-token forward captured in a CUDA graph (compiled outside the capture), replayed on
    other routed inputs copied into the captured ones, equals the eager forward on those."""
    x, ids, w = routed_inputs(4, h, e, k, seed=0)
    with torch.inference_mode():
        mod(x, ids, w)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mod(x, ids, w)
        x2, ids2, w2 = routed_inputs(4, h, e, k, seed=5)
        x.copy_(x2)
        ids.copy_(ids2)
        w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mod(x2, ids2, w2))
