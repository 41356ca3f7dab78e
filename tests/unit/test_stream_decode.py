"""The stream-K decode GEMM (milepost/kernels/stream_decode.py) against fp32 references: fp8
blockwise (each K block's product scaled by both scales) and 16-bit operands, tiles split between
programs or not, pieces summed by ticket or by the second kernel (the same bits), swapped and
plain MMA layouts, several row blocks. Without CUDA it runs under Triton's interpreter, where
the kernel sees 8 SMs.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from milepost.kernels.fp8_gemm import emulated_block_mm
from milepost.kernels.fp8_quant import quantize_act_1x128
from milepost.kernels.stream_decode import (
    StreamConfig,
    splits_tiles,
    stream_config,
    stream_mm,
    stream_programs,
)
from milepost.lowprec.quantize import quantize
from milepost.testing.hopper_compile import needs_ptxas, run_compiled

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter multiplies bf16 tiles wrongly (a bf16 tl.dot of randn gives ~1e11 here);
# the kernel is the same code for any 16-bit dtype, so the CPU checks it in fp16.
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16
# Hopper's fp8 MMA keeps fewer accumulator bits than fp32 within a K block (the H100 showed 3e-4
# of a row's largest entry, 2026-12-07); a scale read from the wrong row or block is off by far
# more (the operands' scales span six orders of magnitude).
FP8_REL = 2e-3 if DEV == "cuda" else 1e-5


def _fp8_operands(m: int, n: int, k: int, seed: int = 0):
    """Activation rows and weight columns whose scales span orders of magnitude (a scale read
    from the wrong row, K block or tile shows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x = (x * torch.logspace(-1, 1, k // 128).repeat_interleave(128)[None, :]).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n // 128).repeat_interleave(128)[:, None]
    qw = quantize(w, "fp8_block")
    xq, sx = quantize_act_1x128(x.to(DEV))
    return xq, sx, qw.values.to(DEV), qw.scales.to(DEV)


def _close_rows(y: torch.Tensor, ref: torch.Tensor, rel: float) -> bool:
    tol = rel * ref.abs().amax(1, keepdim=True) + 1e-30
    return bool(((y - ref).abs() <= tol).all())


CASES = [  # (m, n, k, config): units = (n / block_n) * (k / block_k) over 8 programs (16: per_sm 2)
    (1, 384, 640, StreamConfig(16, 64, 128, True, 4, 2, 1)),  # 30 units, 3-4 a program: split tiles
    (3, 384, 640, StreamConfig(16, 128, 128, False, 4, 3, 1)),  # 15 units, 1-2 a program
    (20, 256, 384, StreamConfig(16, 64, 128, True, 4, 2, 2)),  # two row blocks, 12 programs of 1
    (40, 1024, 256, StreamConfig(64, 64, 128, False, 4, 3, 1)),  # 32 units, 4 a program: whole tiles
    (70, 512, 1280, StreamConfig(64, 32, 128, True, 4, 3, 1)),  # 160 units, 20 a program: 2 tiles each
]


@pytest.mark.parametrize("m,n,k,cfg", CASES, ids=lambda v: str(v))
def test_fp8_stream_equals_the_block_scaled_product(m: int, n: int, k: int, cfg: StreamConfig) -> None:
    xq, sx, w, sw = _fp8_operands(m, n, k)
    ref = emulated_block_mm(xq.cpu(), sx.cpu(), w.cpu(), sw.cpu(), torch.float32)[:m]
    y = stream_mm(xq, w, torch.float32, sx=sx, sw=sw, m=m, cfg=cfg).cpu()
    assert y.shape == (m, n)
    assert _close_rows(y, ref, FP8_REL)


@pytest.mark.parametrize("swap", [True, False])
def test_split_tiles_sum_to_the_same_bits_by_ticket_or_second_kernel(swap: bool) -> None:
    """30 units over 8 programs (3-4 each: tiles of 5 K blocks split in pieces of 1-4) and, with
    per_sm 2, 16 programs of 1-2 units."""
    xq, sx, w, sw = _fp8_operands(5, 384, 640, seed=1)
    for per_sm in (1, 2):
        cfg = StreamConfig(16, 64, 128, swap, 4, 2, per_sm, ticket=True)
        by_ticket = stream_mm(xq, w, torch.float32, sx=sx, sw=sw, m=5, cfg=cfg)
        by_kernel = stream_mm(xq, w, torch.float32, sx=sx, sw=sw, m=5, cfg=cfg._replace(ticket=False))
        assert torch.equal(by_ticket, by_kernel)
        again = stream_mm(xq, w, torch.float32, sx=sx, sw=sw, m=5, cfg=cfg)
        assert torch.equal(by_ticket, again)  # the counters were back at zero


@pytest.mark.parametrize("m,swap", [(1, True), (24, True), (64, False), (100, False)])
def test_bf16_stream_equals_the_product(m: int, swap: bool) -> None:
    """16-bit operands: the MMA accumulates in fp32 directly; 64-wide K blocks."""
    g = torch.Generator().manual_seed(2)
    n, k = 320, 448
    x = torch.randn(m, k, generator=g).to(HALF)
    w = (torch.randn(n, k, generator=g) * 0.05).to(HALF)
    ref = x.float() @ w.float().t()
    cfg = StreamConfig(16 if swap else 64, 64, 64, swap, 4, 3, 1)
    y = stream_mm(x.to(DEV), w.to(DEV), torch.float32, cfg=cfg).cpu()
    assert _close_rows(y, ref, 1e-5)
    assert stream_mm(x.to(DEV), w.to(DEV), HALF, cfg=cfg).dtype == HALF


def test_first_m_rows_of_padded_operands() -> None:
    """An activation with padded rows (Fp8Act's, rows a multiple of 4) and strided scales:
    only the first m rows are read and written."""
    xq, sx, w, sw = _fp8_operands(8, 256, 384, seed=3)
    ref = emulated_block_mm(xq.cpu(), sx.cpu(), w.cpu(), sw.cpu(), torch.float32)[:6]
    sx_t = sx.t().contiguous().t()  # column-major scales
    y = stream_mm(xq, w, torch.float32, sx=sx_t, sw=sw, m=6).cpu()
    assert y.shape == (6, 256) and _close_rows(y, ref, FP8_REL)


def test_bad_shapes_are_refused_with_the_reason() -> None:
    xq, sx, w, sw = _fp8_operands(4, 256, 384)
    with pytest.raises(ValueError, match="needs both scales"):
        stream_mm(xq, w, torch.float32, sx=sx, m=4)
    with pytest.raises(ValueError, match="block_n"):
        stream_mm(torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV),
                  torch.zeros(96, 64, dtype=torch.bfloat16, device=DEV), torch.float32,
                  cfg=StreamConfig(16, 64, 64, True, 4, 2, 1))


def test_programs_share_the_units_evenly() -> None:
    assert stream_programs(3040, 132, 1) == 132  # the 4B gate_up at 128-wide tiles: 23 or 24 each
    assert stream_programs(5, 8, 2) == 5  # never a program without units
    assert splits_tiles(30, 8, 5) and not splits_tiles(32, 8, 2) and not splits_tiles(5, 5, 1)
    assert stream_config(1, 6144, 2560, True) == StreamConfig(16, 64, 128, True, 4, 6, 1)
    assert stream_config(200, 2560, 9728, False) == StreamConfig(64, 64, 128, False, 4, 5, 1)
    assert stream_config(8, 320, 448, False).block_k == 64  # K not whole 128-wide blocks


_COMPILE_FOR_HOPPER = """
import re
from milepost.kernels.stream_decode import _stream_kernel
from milepost.testing.hopper_compile import compile_sm90

for fp8, swap, stages in ((True, True, 5), (True, False, 3), (False, True, 4)):
    t = "fp8e4nv" if fp8 else "bf16"
    s = "*fp32" if fp8 else "*bf16"
    ptrs = dict(X="*" + t, SX=s, W="*" + t, SW=s, C="*bf16", P="*fp32", CNT="*i32")
    const = dict(BLOCK_M=16 if swap else 64, BLOCK_N=64, BLOCK_K=128 if fp8 else 64, FP8=fp8,
                 SWAP=swap, TICKET=True, STAGES=stages)
    ptx = compile_sm90(_stream_kernel, ptrs, const, 4, stages).asm["ptx"]
    mma = "e4m3.e4m3" if fp8 else "bf16.bf16"
    assert re.search(r"wgmma\\.mma_async\\S*" + mma, ptx), (fp8, swap)
    waits = [int(n) for n in re.findall(r"cp\\.async\\.wait_group\\s+(\\d+)", ptx)]
    groups = 4 if fp8 else 2  # load groups a stage: weight, activation (and both scales)
    assert max(waits) == groups * (stages - 2), (fp8, swap, stages, waits)
"""


@needs_ptxas()
def test_the_persistent_loop_compiles_for_hopper_with_loads_stages_ahead() -> None:
    """sm_90: the tensor-core MMA in fp8 or bf16, and the one loop over units (across tile
    boundaries) keeps the loads of stages - 2 further units in flight while one is multiplied."""
    run_compiled(_COMPILE_FOR_HOPPER)
