"""The FP8 activation quantizer of the H200 GEMMs: 1x128 blocks, bit for bit what
milepost.lowprec.quantize gives (scale = amax / 448 with IEEE division, round-to-nearest-even
saturating E4M3, a block with NaN/Inf gets a NaN scale), so the engine's and the trainer's
activations stay in the contract; shared by fp8_gemm.py and fp8_decode.py. Also the delayed-scaling
trainer's per-tensor quantizer (`quantize_tensor_e4m3`: a given scale, the amax in the same pass).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper): a kernel starts while the one before it finishes
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # this Triton has no grid dependency control: configs asking for it run without
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():  # never called: PDL stays off
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

TILE = 128
# Programmatic dependent launch through an FP8 decode step (issue 23: ~5.5 us of each decode
# GEMM call is fixed cost). True: the kernels that make an FP8 activation (fused_fp8_act.py)
# let the kernel after them launch as they start, and every decode GEMM (fp8_decode.py) is
# launched early, streams its weight rows into L2, then waits (griddepcontrol.wait returns once
# the kernel before it has ended and its writes are visible). None: each decode config's own
# `pdl`, the activation kernels never early; False: nowhere. Read at launch, so at CUDA-graph
# capture; only where the device has it (sm_90+: `pdl_supported`). Off by default: on an H100
# the 4B FP8 engine ran x0.845 with it (x0.975 without the prefetch; docs/low_precision.md).
PDL: bool | None = None


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` may use grid dependency control (Hopper and later)."""
    return _HAS_GDC and device.type == "cuda" and _capability(device.index or 0) >= 9


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def early_launch(device: torch.device) -> dict[str, bool]:
    """The launch option of a kernel that makes a decode GEMM's FP8 activation: with `PDL` on,
    TRIGGER (it calls gdc_launch_dependents first); otherwise nothing (the kernel as before)."""
    return {"TRIGGER": True} if PDL and pdl_supported(device) else {}


@triton.jit
def _round_e4m3(y):
    """y rounded to E4M3 (ties to even, saturating at 448, sign of zero kept, NaN kept) as an
    exactly representable float32, so the final cast has nothing left to round."""
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # floor(log2 a)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3 mantissa bits)
    v = a / step  # a power of two: exact
    r = (v + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 addition rounds to even here
    q = tl.minimum(r * step, 448.0)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    q = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, q)  # noqa: PLR0124 - NaN stays NaN


@triton.jit
def _quant_act_kernel(X, Q, S, stride_x, stride_q, stride_sm, stride_sk, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    if PDL:  # launched before the kernel writing X ended: wait for it; the GEMM reading Q may
        gdc_launch_dependents()  # launch now (it waits for this kernel's end before reading)
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols).to(tl.float32)
    finite = tl.abs(x) < float("inf")  # False for NaN and +-Inf
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), 0)
    bad = tl.min(finite.to(tl.int32), 0) == 0
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    scale = tl.where(bad, float("nan"), scale)
    y = tl.math.div_rn(x, scale)
    tl.store(Q + row * stride_q + cols, _round_e4m3(y).to(tl.float8e4nv))
    tl.store(S + row * stride_sm + g * stride_sk, scale)


@triton.jit
def quant_blocks_1x128(x):
    """x: float32 [R, 128], one 1x128 block a row -> (float8e4nv [R, 128], float32 scales [R]):
    _quant_act_kernel's operations on R blocks at once (so the same bits), for the kernels that
    quantize an activation they just made (fused_fp8_act.py)."""
    finite = tl.abs(x) < float("inf")  # False for NaN and +-Inf
    amax = tl.max(tl.where(finite, tl.abs(x), 0.0), 1)
    bad = tl.min(finite.to(tl.int32), 1) == 0
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    scale = tl.where(bad, float("nan"), scale)
    return _round_e4m3(tl.math.div_rn(x, scale[:, None])).to(tl.float8e4nv), scale


def quantize_act_1x128(x: torch.Tensor, pad_rows: int = 1,
                       pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (K % 128 == 0) -> (float8_e4m3fn [Mp, K], float32 scales [Mp, K/128]) with Mp =
    M rounded up to `pad_rows` (padding rows: zeros, scale 1). The scales are stored M-major
    (stride (1, Mp)): the layout cuBLAS's 1x128 block scaling reads."""
    m, k = x.shape
    mp = -(-m // pad_rows) * pad_rows
    q = torch.empty((mp, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((k // TILE, mp), dtype=torch.float32, device=x.device).t()
    if mp > m:
        q[m:].view(torch.uint8).zero_()
        s[m:] = 1.0
    if m:
        _quant_act_kernel[(m, k // TILE)](x, q, s, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                          BLOCK=TILE, **({"PDL": True, "launch_pdl": True} if pdl else {}))
    return q, s


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


@triton.jit
def _quant_tensor_kernel(X, Q, S, AMAX, BAD, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    finite = tl.abs(x) < float("inf")  # False for NaN and +-Inf; masked lanes are 0: finite
    tl.store(AMAX + pid, tl.max(tl.where(finite, tl.abs(x), 0.0), 0))
    tl.store(BAD + pid, 1 - tl.min(finite.to(tl.int32), 0))
    y = tl.math.div_rn(x, tl.load(S))
    tl.store(Q + offs, _round_e4m3(y).to(tl.float8e4nv), mask=mask)


def quantize_tensor_e4m3(x: torch.Tensor, scale: torch.Tensor, block: int = 4096
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (any shape) under one float32 0-d `scale` -> (float8_e4m3fn like x, float32 0-d amax of
    its finite values, bool 0-d "holds NaN/Inf") in one pass over x: the elements are
    `to_e4m3(x / scale)` bit for bit (IEEE division, nearest-even, saturating), the amax the
    delayed-scaling history records. No host sync."""
    x = x.contiguous()
    n = x.numel()
    parts = max(1, triton.cdiv(n, block))
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    amax = torch.zeros(parts, dtype=torch.float32, device=x.device)
    bad = torch.zeros(parts, dtype=torch.int32, device=x.device)
    if n:
        _quant_tensor_kernel[(parts,)](x, q, scale.float().contiguous(), amax, bad, n, BLOCK=block)
    return q, amax.amax(), bad.amax() > 0
