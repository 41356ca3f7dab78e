"""FP8 blockwise GEMM on Hopper: y = Q(x) @ Q(W)^T with 1x128 activation and 128x128 weight scales.

`quantize_act_1x128` is one Triton kernel that gives bit-for-bit what milepost.lowprec.quantize
gives (scale = amax / 448 with IEEE division, round-to-nearest-even saturating E4M3, a block with
NaN/Inf gets a NaN scale): the engine's and the trainer's activations stay in the contract.
The GEMM is cuBLAS's block-scaled FP8 GEMM through `torch._scaled_mm` (M-major 1x128 scales, M
padded to a multiple of 4; K/128 a multiple of 4, see `cublas_takes`) where a probe on operands
whose scales differ by orders of magnitude gives the emulated product, else a Triton kernel
(DeepSeek-V3's recipe: per 128-wide K step, an FP8 tensor-core product scaled by both blocks'
scales, accumulated in fp32), else emulated with a warning; at decode batch sizes (M <=
DECODE_M) the faster of the correct ones, timed once from CUDA graphs.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)
TILE = 128
_BACKEND: dict[int, str] = {}  # device -> GEMM for any M
_SMALL: dict[int, str] = {}  # device -> GEMM for M <= DECODE_M
_ROWS: dict[int, str] = {}  # device -> weight-gradient GEMM (both operands 1x128 along tokens)
DECODE_M = 64


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
def _quant_act_kernel(X, Q, S, stride_x, stride_q, stride_sm, stride_sk, BLOCK: tl.constexpr):
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


def quantize_act_1x128(x: torch.Tensor, pad_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
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
                                          BLOCK=TILE)
    return q, s


@triton.jit
def _gemm_kernel(A, SA, B, SB, C, M, N, K, stride_a, stride_b, stride_c, stride_cs, stride_sam,
                 stride_sak, stride_sbn, stride_sbk, n_kb, kb_per, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_ROWS: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k * kb_per, tl.minimum(pid_k * kb_per + kb_per, n_kb)):
        a = tl.load(A + rm[:, None] * stride_a + (kb * BLOCK_K + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(B + rn[:, None] * stride_b + (kb * BLOCK_K + rk)[None, :], mask=rn[:, None] < N, other=0.0)
        sa = tl.load(SA + rm * stride_sam + kb * stride_sak, mask=rm < M, other=0.0)
        if B_ROWS:  # B quantized 1x128 per row too (the weight-gradient GEMM)
            sb = tl.load(SB + rn * stride_sbn + kb * stride_sbk, mask=rn < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        else:  # B in 128x128 tiles: BLOCK_N divides 128, so one scale per (N tile, K block)
            sb = tl.load(SB + (pid_n * BLOCK_N // 128) * stride_sbn + kb * stride_sbk)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
    tl.store(C + pid_k * stride_cs + rm[:, None] * stride_c + rn[None, :],
             acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def triton_block_mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype, b_rows: bool = False) -> torch.Tensor:
    """xq [M, K] fp8, sx [M, K/128]; w [N, K] fp8, sw [N/128, K/128] (b_rows: [N, K/128], w
    quantized 1x128 per row) -> [M, N] out_dtype. Scales may have any strides."""
    m, k = xq.shape
    n, n_kb = w.shape[0], k // TILE
    # Small M (decode) reads the weight once: narrow N blocks, and the K blocks split over
    # programs until every SM streams a part of the weight; the parts' fp32 sums are added in
    # a fixed order (deterministic, unlike atomics).
    bm, bn = (16, 32) if m <= 16 else ((64, 64) if m <= 64 else (128, 128))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = min(n_kb, max(1, 2 * _sm_count(xq.device) // tiles)) if m <= 64 else 1
    kb_per = triton.cdiv(n_kb, split)
    split = triton.cdiv(n_kb, kb_per)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    part = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _gemm_kernel[grid](xq, sx, w, sw, part, m, n, k, xq.stride(0), w.stride(0), n, m * n,
                       sx.stride(0), sx.stride(1), sw.stride(0), sw.stride(1), n_kb, kb_per,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=TILE, B_ROWS=b_rows)
    return out if split == 1 else part.sum(0).to(out_dtype)


def cublas_takes(k: int) -> bool:
    """Whether cuBLAS's block-scaled GEMM gives the right product for contraction dim k. It
    reads the 128x128 weight scales with a 16-byte aligned leading dimension, which torch
    2.11's _scaled_mm cannot express: K/128 must be a multiple of 4 (measured on the H200:
    K = 640 gave a wrong product, K = 512 the right one; every Qwen3 K qualifies)."""
    return k % TILE == 0 and (k // TILE) % 4 == 0


_FALLBACK: dict[int, str] = {}  # device -> GEMM for the K that cuBLAS does not take


def scaled_mm_block(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's FP8 GEMM with 1x128 x 128x128 block scaling through torch._scaled_mm (xq [M, K],
    w [N, K] fp8). The 1x128 scales are M-major with M padded to a multiple of 4 (cuBLAS
    refuses M = 1 and 2: their leading dimension must be 16-byte aligned); the weight scales
    K-major. A K that cuBLAS does not take (cublas_takes) goes to the fallback GEMM."""
    m, k = xq.shape
    if not cublas_takes(k):
        fallback = _FALLBACK.get(xq.device.index or 0, "emulated")
        return {"triton": triton_block_mm, "emulated": emulated_block_mm}[fallback](
            xq, sx, w, sw, out_dtype)
    if m % 4 or sx.stride(0) != 1:
        mp = -(-m // 4) * 4
        xq2 = torch.zeros((mp, k), dtype=torch.uint8, device=xq.device)
        xq2[:m] = xq.view(torch.uint8)
        s2 = torch.ones((sx.shape[1], mp), dtype=torch.float32, device=xq.device)
        s2[:, :m] = sx.t()
        xq, sx = xq2.view(torch.float8_e4m3fn), s2.t()
    out = torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=sw.contiguous().t(), out_dtype=out_dtype)
    return out[:m]


def rows_mm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor,
            out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """aq [M, T] x bq [N, T]^T with both quantized 1x128 along T (the weight-gradient GEMM;
    scales [M, T/128], [N, T/128]). scaled_mm needs T/128 a multiple of 4 and M-major scales."""
    if backend == "scaled_mm":
        return torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)
    if backend == "triton":
        return triton_block_mm(aq, sa, bq, sb, out_dtype, b_rows=True)
    return ((aq.float() * sa.repeat_interleave(TILE, 1))
            @ (bq.float() * sb.repeat_interleave(TILE, 1)).t()).to(out_dtype)


def _probe_rows(device: torch.device) -> str:
    """The first of cuBLAS, Triton that gives the emulated weight-gradient product."""
    gen = torch.Generator(device=device).manual_seed(1)
    a = torch.randn(256, 1024, device=device, generator=gen) * torch.logspace(-2, 2, 256, device=device)[:, None]
    b = torch.randn(384, 1024, device=device, generator=gen) * torch.logspace(2, -2, 384, device=device)[:, None]
    (aq, sa), (bq, sb) = quantize_act_1x128(a), quantize_act_1x128(b)
    ref = rows_mm(aq, sa, bq, sb, torch.float32, "emulated")
    for name in ("scaled_mm", "triton"):
        try:
            out = rows_mm(aq, sa, bq, sb, torch.bfloat16, name).float()
            torch.cuda.synchronize(device)
            if _agrees(out, ref):
                return name
            log.warning("fp8 weight-gradient GEMM %s: wrong product (max diff %.3g); not used",
                        name, (out - ref).abs().max().item())
        except Exception as e:  # noqa: BLE001 - unsupported here
            log.warning("fp8 weight-gradient GEMM %s not used: %s", name, str(e).splitlines()[0][:200])
    return "emulated"


def emulated_block_mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    x = xq.float() * sx.repeat_interleave(TILE, 1)
    wd = w.float() * sw.repeat_interleave(TILE, 0)[: w.shape[0]].repeat_interleave(TILE, 1)
    return (x @ wd.t()).to(out_dtype)


def _probe_cases(device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """Operands whose scales differ by orders of magnitude per row, K block and weight tile (a
    scale read from the wrong place shows), at the M a decode and a prefill give."""
    from milepost.lowprec.quantize import quantize

    gen = torch.Generator(device=device).manual_seed(0)
    cases = []
    for m, n, k in ((1, 384, 512), (3, 256, 640), (64, 384, 512), (200, 384, 512), (300, 256, 1024)):
        x = torch.randn(m, k, device=device, generator=gen)
        x = x * torch.logspace(-2, 2, m, device=device)[:, None]
        x = x * torch.logspace(-1, 1, k // TILE, device=device).repeat_interleave(TILE)[None, :]
        w = torch.randn(n, k, device=device, generator=gen) * 0.05
        w = w * torch.logspace(-1, 1, -(-n // TILE), device=device).repeat_interleave(TILE)[:n, None]
        qw = quantize(w, "fp8_block")
        xq, sx = quantize_act_1x128(x.to(torch.bfloat16))
        cases.append((xq, sx, qw.values, qw.scales))
    return cases


def _agrees(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """bf16 output vs the fp32 emulated product: per-row tolerance (rows differ in scale)."""
    tol = 1e-2 * ref.abs() + 1e-2 * ref.abs().amax(1, keepdim=True) + 1e-30
    return bool(torch.isfinite(out).all() and ((out - ref).abs() <= tol).all())


def _probe(device: torch.device) -> list[str]:
    """The GEMMs that give the emulated product on every probe case (cuBLAS first), warning
    for each one that does not."""
    cases = _probe_cases(device)
    refs = [emulated_block_mm(*c, torch.float32) for c in cases]
    ok: list[str] = []
    for name in ("triton", "scaled_mm"):
        if name == "scaled_mm":  # the K cuBLAS does not take go to the checked fallback
            _FALLBACK[device.index or 0] = "triton" if ok else "emulated"
        try:
            for c, ref in zip(cases, refs):
                out = (triton_block_mm if name == "triton" else scaled_mm_block)(*c, torch.bfloat16)
                torch.cuda.synchronize(device)
                if not _agrees(out.float(), ref):
                    raise ValueError(f"wrong product at M={c[0].shape[0]}, N={c[2].shape[0]}, "
                                     f"K={c[0].shape[1]} (max diff {(out.float() - ref).abs().max().item():.3g})")
            ok.append(name)
        except Exception as e:  # noqa: BLE001 - unsupported by this torch/cuBLAS/Triton, or wrong
            log.warning("fp8 blockwise GEMM %s not used: %s", name, str(e).splitlines()[0][:200])
    return sorted(ok, key=lambda n: n != "scaled_mm")


def _replay_ms(fn, device: torch.device, reps: int = 20) -> float:
    """Milliseconds per call of `fn` replayed from a CUDA graph, as the engine's decode runs it
    (eager when it cannot be captured): launch costs are not what is compared."""
    fn()
    torch.cuda.synchronize(device)
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    except Exception as e:  # noqa: BLE001 - time it eagerly then
        log.info("fp8 GEMM timing without a CUDA graph: %s", str(e).splitlines()[0][:120])
    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps


def _faster_at_decode(device: torch.device, names: list[str]) -> str:
    """The faster of the correct GEMMs at a decode batch (the weight's bytes dominate there)."""
    w = torch.randn(4096, 4096, device=device).to(torch.float8_e4m3fn)
    sw = torch.full((32, 32), 1e-3, device=device)
    x = torch.randn(DECODE_M // 2, 4096, device=device, dtype=torch.bfloat16)
    ms = {n: _replay_ms(lambda n=n: fp8_block_linear(x, w, sw, n), device) for n in names}
    log.info("fp8 blockwise GEMM at M=%d: %s", DECODE_M // 2,
             ", ".join(f"{n} {t * 1e3:.1f} us" for n, t in ms.items()))
    return min(ms, key=ms.__getitem__)


def block_backend(device: torch.device, m: int | None = None) -> str:
    """'scaled_mm' | 'triton' | 'emulated' for this CUDA device, and for `m` rows when given
    (at most DECODE_M: the faster correct one). Probed once, on operands that show a wrong
    scale layout; a fallback from cuBLAS is announced with a warning."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _BACKEND:
        dev = torch.device("cuda", idx)
        ok = _probe(dev) or ["emulated"]
        small = _faster_at_decode(dev, ok) if len(ok) > 1 else ok[0]
        _BACKEND[idx], _SMALL[idx] = ok[0], small
        _ROWS[idx] = _probe_rows(dev) if ok[0] != "emulated" else "emulated"
        level = logging.INFO if ok[0] == "scaled_mm" else logging.WARNING
        log.log(level, "fp8 blockwise GEMM on cuda:%d: %s (M <= %d: %s; weight gradient: %s)%s",
                idx, ok[0], DECODE_M, small, _ROWS[idx],
                "" if ok[0] != "emulated" else "; dequantized bf16 GEMMs: slow")
    return _SMALL[idx] if m is not None and m <= DECODE_M else _BACKEND[idx]


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                     backend: str | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) times fp8 weight w [N, K] with 128x128 scales sw."""
    shape = x.shape
    m = x.numel() // shape[-1]
    backend = backend or block_backend(x.device, m)
    pad = 4 if backend == "scaled_mm" else 1
    xq, sx = quantize_act_1x128(x.reshape(-1, shape[-1]).contiguous(), pad)
    fn = {"scaled_mm": scaled_mm_block, "triton": triton_block_mm,
          "emulated": emulated_block_mm}[backend]
    return fn(xq, sx, w, sw, x.dtype)[:m].reshape(*shape[:-1], w.shape[0])


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
        block_backend(x.device)
        rows = _ROWS[x.device.index if x.device.index is not None else torch.cuda.current_device()]
        # The tokens are the contraction dim here: zero-padded to whole 1x128 blocks (cuBLAS:
        # a multiple of 4 blocks).
        pad = (-gy2.shape[0]) % (4 * TILE if rows == "scaled_mm" else TILE)
        gq, sg = quantize_act_1x128(torch.nn.functional.pad(gy2.t(), (0, pad)).contiguous())
        xq, sx = quantize_act_1x128(torch.nn.functional.pad(x2.t(), (0, pad)).contiguous())
        gw = rows_mm(gq, sg, xq, sx, gy.dtype, rows)
        return gx.reshape(x.shape), gw, None, None
