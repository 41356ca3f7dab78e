"""FP8 blockwise GEMM on Hopper: y = Q(x) @ Q(W)^T with 1x128 activation and 128x128 weight scales.

`quantize_act_1x128` is one Triton kernel that gives bit-for-bit what milepost.lowprec.quantize
gives (scale = amax / 448 with IEEE division, round-to-nearest-even saturating E4M3, a block with
NaN/Inf gets a NaN scale): the engine's and the trainer's activations stay in the contract.
The GEMM is `torch._scaled_mm` with blockwise scales where this torch has it (probed once per
device against the emulated product), else a Triton kernel (DeepSeek-V3's recipe: per 128-wide
K step, an FP8 tensor-core product scaled by both blocks' scales, accumulated in fp32).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
TILE = 128
_BACKEND: dict[int, str] = {}


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
def _quant_act_kernel(X, Q, S, stride_x, stride_q, n_groups, BLOCK: tl.constexpr):
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
    tl.store(S + row * n_groups + g, scale)


def quantize_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (K % 128 == 0) -> (float8_e4m3fn [M, K], float32 scales [M, K/128])."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, k // TILE), dtype=torch.float32, device=x.device)
    if m:
        _quant_act_kernel[(m, k // TILE)](x, q, s, x.stride(0), q.stride(0), k // TILE, BLOCK=TILE)
    return q, s


@triton.jit
def _gemm_kernel(A, SA, B, SB, C, M, N, K, stride_a, stride_b, stride_c, n_kb,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 B_ROWS: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(n_kb):
        a = tl.load(A + rm[:, None] * stride_a + (kb * BLOCK_K + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(B + rn[:, None] * stride_b + (kb * BLOCK_K + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        sa = tl.load(SA + rm * n_kb + kb, mask=rm < M, other=0.0)
        if B_ROWS:  # B quantized 1x128 per row too (the weight-gradient GEMM)
            sb = tl.load(SB + rn * n_kb + kb, mask=rn < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        else:  # B in 128x128 tiles: one scale per (N tile, K block)
            sb = tl.load(SB + (pid_n * BLOCK_N // 128) * n_kb + kb)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
    tl.store(C + rm[:, None] * stride_c + rn[None, :], acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_block_mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype, b_rows: bool = False) -> torch.Tensor:
    """xq [M, K] fp8, sx [M, K/128]; w [N, K] fp8, sw [N/128, K/128] (b_rows: [N, K/128], w
    quantized 1x128 per row) -> [M, N] out_dtype."""
    m, k = xq.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    bm = 16 if m <= 16 else (64 if m <= 64 else 128)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, TILE))
    _gemm_kernel[grid](xq, sx, w, sw, out, m, n, k, xq.stride(0), w.stride(0), out.stride(0),
                       k // TILE, BLOCK_M=bm, BLOCK_N=TILE, BLOCK_K=TILE, B_ROWS=b_rows)
    return out


# Scale layouts cuBLAS may want for 1x128 (a) x 128x128 (b) scaling; the probe keeps the first
# that gives the right product (torch versions differ in what they accept).
_LAYOUTS = (
    lambda sx, sw: (sx.t().contiguous().t(), sw.t()),
    lambda sx, sw: (sx, sw.t()),
    lambda sx, sw: (sx.t().contiguous().t(), sw.t().contiguous()),
    lambda sx, sw: (sx, sw.t().contiguous()),
)
_LAYOUT: dict[int, int] = {}


def scaled_mm_block(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype, layout: int | None = None) -> torch.Tensor:
    """torch._scaled_mm with blockwise scales (xq [M, K], w [N, K] fp8)."""
    sa, sb = _LAYOUTS[_LAYOUT.get(xq.device.index or 0, 0) if layout is None else layout](sx, sw)
    return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def emulated_block_mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    x = xq.float() * sx.repeat_interleave(TILE, 1)
    wd = w.float() * sw.repeat_interleave(TILE, 0)[: w.shape[0]].repeat_interleave(TILE, 1)
    return (x @ wd.t()).to(out_dtype)


def _probe(device: torch.device) -> str:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 512, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(384, 512, device=device, generator=gen) * 0.05
    from milepost.lowprec.quantize import quantize

    qw = quantize(w, "fp8_block")
    xq, sx = quantize_act_1x128(x)
    ref = emulated_block_mm(xq, sx, qw.values, qw.scales, torch.float32)
    tries = [("scaled_mm", i) for i in range(len(_LAYOUTS))] + [("triton", None)]
    for name, layout in tries:
        try:
            if name == "scaled_mm":
                out = scaled_mm_block(xq, sx, qw.values, qw.scales, torch.bfloat16, layout).float()
            else:
                out = triton_block_mm(xq, sx, qw.values, qw.scales, torch.bfloat16).float()
            if torch.allclose(out, ref, rtol=2e-2, atol=2e-2):
                if layout is not None:
                    _LAYOUT[device.index or 0] = layout
                return name
            log.warning("fp8 blockwise %s (layout %s): wrong result (max diff %.3g); not used",
                        name, layout, (out - ref).abs().max().item())
        except Exception as e:  # noqa: BLE001 - an unsupported layout or an old torch
            log.warning("fp8 blockwise %s (layout %s) unavailable: %s", name, layout,
                        str(e).splitlines()[0][:200])
    return "emulated"


def block_backend(device: torch.device) -> str:
    """'scaled_mm' | 'triton' | 'emulated' for this CUDA device (probed once)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _BACKEND:
        _BACKEND[idx] = _probe(torch.device("cuda", idx))
        log.info("fp8 blockwise GEMM on cuda:%d: %s", idx, _BACKEND[idx])
    return _BACKEND[idx]


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                     backend: str | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) times fp8 weight w [N, K] with 128x128 scales sw."""
    shape = x.shape
    xq, sx = quantize_act_1x128(x.reshape(-1, shape[-1]).contiguous())
    fn = {"scaled_mm": scaled_mm_block, "triton": triton_block_mm,
          "emulated": emulated_block_mm}[backend or block_backend(x.device)]
    return fn(xq, sx, w, sw, x.dtype).reshape(*shape[:-1], w.shape[0])


class Fp8BlockLinearFn(torch.autograd.Function):
    """The trainer's FP8 linear on Hopper: the three GEMMs in FP8 with the values the emulated
    path (milepost/lowprec/linear.py) uses: forward x (1x128) x W (128x128); data gradient
    gy (1x128 along N) x W^T (the same tiles transposed); weight gradient gy^T x x^T, both
    1x128 along the tokens (zero-padded to a multiple of 128). The weight's gradient goes
    straight through to the master weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wv: torch.Tensor,
                ws: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, wv, ws)
        return fp8_block_linear(x, wv, ws)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x, wv, ws = ctx.saved_tensors
        x2, gy2 = x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1]).contiguous()
        gx = fp8_block_linear(gy2, wv.t().contiguous(), ws.t().contiguous())
        pad = (-gy2.shape[0]) % TILE
        gq, sg = quantize_act_1x128(torch.nn.functional.pad(gy2.t(), (0, pad)).contiguous())
        xq, sx = quantize_act_1x128(torch.nn.functional.pad(x2.t(), (0, pad)).contiguous())
        gw = triton_block_mm(gq, sg, xq, sx, gy.dtype, b_rows=True)
        return gx.reshape(x.shape), gw, None, None
