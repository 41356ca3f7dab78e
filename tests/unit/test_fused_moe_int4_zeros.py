"""INT4 MoE experts with zero points (AWQ, asymmetric GPTQ / compressed-tensors served as stored):
the store's torch dequantization, the Triton dequantization and the fused W4A16 MoE kernels
(gate_up and down) compute (v - zero) * scale in float32, as the dense INT4 path does.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before importing
triton), in fp32 (its bf16 tl.dot is broken): bit for bit against the bf16 fused kernel on the
dequantized weights with the same config, as tests/unit/test_fused_moe_int4.py checks the
symmetric kernels; bf16 on the GPU is tests/gpu/test_fused_moe_int4_zeros_cuda.py's. Hidden 201
and intermediate 136: partial groups and a pad nibble on both GEMMs' K. Zero points differ per
expert, row and group, so one read from the wrong place shows.
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
i4 = importlib.import_module("milepost.kernels.int4_gemm")

from milepost.lowprec.experts_int4 import Int4Experts, Int4StackedExperts, dequantize_packed
from milepost.lowprec.quantize import QTensor, dequantize, quantize
from milepost.models.qwen3_moe import StackedExperts
from milepost.testing.hopper_compile import needs_ptxas, run_compiled
from milepost.testing.int4_moe_interp import assert_fused_int4_is_the_bf16_kernel, crowded_routing, small_int4_experts

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I, K = 6, 201, 136, 3
CONFIGS = [
    (1, fm.MoeConfig(16, fm.GemmConfig(32, 64, swap_ab=True), fm.GemmConfig(64, 32, swap_ab=True))),
    (7, fm.MoeConfig(16, fm.GemmConfig(64, 64), fm.GemmConfig(64, 128))),
]


def _zeros(shape: torch.Size, seed: int) -> torch.Tensor:
    """Store offsets (zero - 8): AWQ's -8..7 and asymmetric GPTQ v1's 8."""
    return torch.randint(-8, 9, tuple(shape), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int8)


@pytest.fixture(scope="module")
def experts() -> Int4StackedExperts:
    """INT4 experts packed by the engine's store, then given zero points through `put` (a
    checkpoint's tensors arrive that way); scales spread over six orders of magnitude along H."""
    mod = small_int4_experts(E, H, I)
    assert mod.w13_zero is None
    z13, z2 = _zeros(mod.w13_scale.shape, 1), _zeros(mod.w2_scale.shape, 2)
    for e in range(E):
        for which in (0, 1, 2):
            q = mod.qtensor(e, which)
            z = z2[e] if which == 2 else z13[e, which * I:(which + 1) * I]
            mod.put(e, which, QTensor("int4", q.values.clone(), q.scales.clone(), q.tile, q.shape,
                                      zeros=z))
    assert torch.equal(mod.w13_zero, z13) and torch.equal(mod.w2_zero, z2)
    return mod


def _inputs(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return crowded_routing(t, E, H, seed)


def _dev(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [t.detach().to(DEV) if t is not None else None for t in ts]


def test_the_torch_dequantization_subtracts_the_zero_before_scaling(experts: Int4StackedExperts) -> None:
    """dequantize_packed = quantize.dequantize of each HF tensor with its zero points (the dense
    store's function), for the whole stack and per expert; the zero points change the weights;
    the Triton dequantization (the CUDA path of `_dequantize`) gives the same bits."""
    w13 = dequantize_packed(experts.w13, experts.w13_scale, H, torch.float32, experts.w13_zero)
    w2 = dequantize_packed(experts.w2, experts.w2_scale, I, torch.float32, experts.w2_zero)
    for e in range(E):
        assert torch.equal(w13[e, :I], dequantize(experts.qtensor(e, 0)))
        assert torch.equal(w13[e, I:], dequantize(experts.qtensor(e, 1)))
        assert torch.equal(w2[e], dequantize(experts.qtensor(e, 2)))
    plain = dequantize_packed(experts.w13, experts.w13_scale, H, torch.float32)
    assert not torch.equal(w13, plain)
    assert torch.equal(experts.expert_weights()[0], w13)  # the module's CPU path
    for dtype in (torch.float32, torch.float16):
        flat = (experts.w13.reshape(E * 2 * I, -1), experts.w13_scale.reshape(E * 2 * I, -1),
                experts.w13_zero.reshape(E * 2 * I, -1))
        got = i4.dequantize_int4_triton(flat[0].to(DEV), flat[1].to(DEV), H, dtype, flat[2].to(DEV))
        assert torch.equal(got.cpu().reshape(E, 2 * I, H),
                           dequantize_packed(experts.w13, experts.w13_scale, H, dtype, experts.w13_zero))


@pytest.mark.parametrize("tokens,cfg", CONFIGS, ids=["1-swap", "7-noswap"])
def test_fused_int4_with_zeros_equals_dequantize_then_the_bf16_kernel(
        experts: Int4StackedExperts, tokens: int, cfg: fm.MoeConfig) -> None:
    """Bit for bit under the interpreter (fp32: the same tiles on the same products, gate_up and
    down both reading their zero points), within fp32 rounding of the module's per-expert loop,
    and not the product without zero points."""
    x, ids, w = _inputs(tokens, tokens)
    got = assert_fused_int4_is_the_bf16_kernel(experts, x, ids, w, cfg, DEV)
    args = _dev(experts.w13, experts.w13_scale, experts.w2, experts.w2_scale)
    zeros = _dev(experts.w13_zero, experts.w2_zero)
    xs = _dev(x, ids, w)
    # Each GEMM reads its own zero points: dropping either changes the result.
    for drop in ((zeros[0], None), (None, zeros[1])):
        other = f4.fused_expert_mlp_int4(*xs, *args, cfg, *drop).cpu()
        assert not torch.allclose(other, got, rtol=1e-3, atol=1e-4)


def test_bad_zero_points_are_refused(experts: Int4StackedExperts) -> None:
    x, ids, w = _dev(*_inputs(2, 0))
    args = _dev(experts.w13, experts.w13_scale, experts.w2, experts.w2_scale)
    cfg = f4._fit(CONFIGS[1][1])
    with pytest.raises(ValueError, match=r"zero points z13: torch.int32 .* expected int8"):
        f4.fused_expert_mlp_int4(x, ids, w, *args, cfg, experts.w13_zero.to(DEV, torch.int32), None)
    with pytest.raises(ValueError, match=r"zero points z2: torch.int8 \(6, 201, 1\)"):
        f4.fused_expert_mlp_int4(x, ids, w, *args, cfg, None, experts.w2_zero[..., :1].to(DEV))


def test_an_update_requantizes_symmetric_and_zeroes_its_zero_points(experts: Int4StackedExperts) -> None:
    """The registry's write (every transport) quantizes the sent tensor with the shared symmetric
    quantizer and sets that tensor's zero points to 0; the other tensors keep theirs. A stacked
    (transformers 5) name re-quantizes every expert's tensors."""
    import copy

    mod = copy.deepcopy(experts)
    reg = Int4Experts([mod])
    g = torch.Generator().manual_seed(3)
    up = torch.randn(I, H, generator=g)
    reg.write(mod.w13[2, I:], up)
    q = mod.qtensor(2, 1)
    assert not q.zeros.any() and torch.equal(dequantize(q), dequantize(quantize(up, "int4")))
    assert torch.equal(mod.w13_zero[2, :I], experts.w13_zero[2, :I])  # gate keeps its zeros
    assert torch.equal(mod.w13_zero[3], experts.w13_zero[3])
    values, _ = reg.dequantized(mod.w13[2, I:])
    assert torch.equal(values, dequantize(quantize(up, "int4")))
    down = torch.randn(E, H, I, generator=g)
    reg.write(mod.w2, down)
    assert not mod.w2_zero.any()
    want = dequantize(quantize(down.reshape(-1, I), "int4")).reshape(E, H, I)
    assert torch.equal(reg.dequantized(mod.w2)[0], want)
    with torch.no_grad():  # the forward multiplies exactly those weights
        x, ids, w = _inputs(3, 4)
        w13, w2 = mod.expert_weights()
        assert torch.equal(mod(x, ids, w), StackedExperts.forward(_plain(w13, w2), x, ids, w))


def _plain(w13: torch.Tensor, w2: torch.Tensor) -> StackedExperts:
    m = StackedExperts(E, H, I)
    with torch.no_grad():
        m.w13.copy_(w13)
        m.w2.copy_(w2)
    return m


# The kernels with zero points compiled for the H100/H200 (sm_90), no GPU needed, in a process of
# its own (the interpreter patches triton.language globally): the bf16 kernels' MMA instructions,
# as many per tile, so the zero points change what the tile holds, not how it is multiplied.
_COMPILE = """
from milepost.testing.hopper_compile import fused_moe_mmas

for swap in (True, False):
    for kind in ("gate_up", "down"):
        bf16, int4 = fused_moe_mmas(kind, swap, zero=True)
        assert bf16 and bf16 == int4, (kind, swap, bf16, int4)
"""


@needs_ptxas()
def test_kernels_with_zero_points_compile_for_hopper_to_the_bf16_kernels_mma_instructions() -> None:
    run_compiled(_COMPILE)
