"""FP8 blockwise GEMM on Hopper: y = Q(x) @ Q(W)^T with 1x128 activation and 128x128 weight scales.

The activations are quantized by `quantize_act_1x128` (fp8_quant.py: the reference's bits).
The GEMM is cuBLAS's block-scaled FP8 GEMM through `torch._scaled_mm` (M-major 1x128 scales, M
padded to a multiple of 4; K/128 a multiple of 4, see `cublas_takes`) where a probe on operands
whose scales differ by orders of magnitude gives the emulated product, else a Triton kernel
(DeepSeek-V3's recipe: per 128-wide K step, an FP8 tensor-core product scaled by both blocks'
scales, accumulated in fp32), else emulated with a warning. At decode batch sizes (M <=
DECODE_M) two more compete, `decode_block_mm` (fp8_decode.py: a split-K FP8 GEMM with
configs measured per shape) and `stream_mm` (stream_decode.py: one wave of persistent programs
streaming equal shares of the weight); per M bucket the fastest correct GEMM is used, timed once
from CUDA graphs. An activation already quantized by the kernel that made it (an Fp8Act: the norms and
SiLU * up of kernels/fused_fp8_act.py) takes `fp8_act_linear`: the same GEMMs, no quantize launch.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from milepost.kernels.fp8_decode import (  # noqa: F401 - DECODE_* and DecodeConfig re-exported
    _FAILED,
    DECODE_BUCKETS,
    DECODE_TABLE,
    DecodeConfig,
    decode_block_mm,
    decode_block_mm_quantized,
    decode_config,
)
from milepost.kernels.fp8_quant import TILE, _round_e4m3, _sm_count, quantize_act_1x128  # noqa: F401
from milepost.kernels.fused_fp8_act import quantize_rows_fp8
from milepost.kernels.stream_decode import StreamConfig, stream_config, stream_mm
from milepost.lowprec.fp8_act import Fp8Act, SplitSum

log = logging.getLogger(__name__)
_BACKEND: dict[int, str] = {}  # device -> GEMM for any M
_SMALL: dict[int, dict[int, str]] = {}  # device -> M bucket (<= DECODE_M) -> GEMM
_ROWS: dict[int, str] = {}  # device -> weight-gradient GEMM (both operands 1x128 along tokens)
DECODE_M = 256
# Whether the stream-K kernel competes at decode M (an A/B switch for whole-engine runs, read by the
# probe: benchmarks/lowprec_gpu.py's fp8_block_nostream mode).
STREAM = True


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
    scale read from the wrong place shows), at the M a decode and a prefill give:
    (xq, sx, w, sw, x) with x the bf16 activation that xq, sx quantize."""
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
        xb = x.to(torch.bfloat16)
        xq, sx = quantize_act_1x128(xb)
        cases.append((xq, sx, qw.values, qw.scales, xb))
    return cases


def _agrees(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """bf16 output vs the fp32 emulated product: per-row tolerance (rows differ in scale)."""
    tol = 1e-2 * ref.abs() + 1e-2 * ref.abs().amax(1, keepdim=True) + 1e-30
    return bool(torch.isfinite(out).all() and ((out - ref).abs() <= tol).all())


def _decode_variants(m: int, n: int, k: int, sms: int, option: str = "") -> list[DecodeConfig]:
    """decode_config's choice and its opposite in fusion, wide and narrow blocks, an uneven K
    split; or (option) the parts summed by ticket, the narrow quantization: the code paths the
    table's configs take."""
    cfg = decode_config(m, n, k, sms)._replace(ticket=False, narrow=False)
    if option == "ticket":
        return [cfg._replace(split=3, ticket=True), cfg._replace(split=2, ticket=True, fused=not cfg.fused)]
    if option == "narrow":
        return [cfg._replace(fused=True, narrow=True), cfg._replace(fused=True, narrow=True, block_m=32)]
    return [cfg, cfg._replace(block_n=128, split=3, stages=3, fused=not cfg.fused),
            cfg._replace(block_n=32, split=1, stages=2),
            cfg._replace(block_m=64, block_n=256, split=2, warps=8, stages=3)]


def _stream_variants(m: int, n: int, k: int) -> list[StreamConfig]:
    """stream_config's choice, the other MMA layout, the pieces summed by the second kernel, two
    programs an SM and 128-wide weight tiles: the code paths a config can take."""
    cfg = stream_config(m, n, k, True)
    return [cfg, cfg._replace(swap=not cfg.swap, block_m=16 if cfg.swap else 64, ticket=False),
            cfg._replace(per_sm=2, block_n=128, stages=3)]


def _run_case(name: str, case: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    xq, sx, w, sw, x = case
    if name == "stream":
        m = x.shape[0]
        return [stream_mm(xq, w, torch.bfloat16, sx=sx, sw=sw, m=m, cfg=c)
                for c in _stream_variants(m, w.shape[0], x.shape[1])]
    if name.startswith("decode"):
        m, k = x.shape
        return [decode_block_mm(x, w, sw, torch.bfloat16, c) for c in _decode_variants(
            m, w.shape[0], k, _sm_count(x.device), name[7:])]
    return [(triton_block_mm if name == "triton" else scaled_mm_block)(xq, sx, w, sw, torch.bfloat16)]


def _probe(device: torch.device) -> list[str]:
    """The GEMMs that give the emulated product on every probe case (cuBLAS first, the decode
    kernel last: it serves only decode M), warning for each one that does not."""
    cases = _probe_cases(device)
    refs = [emulated_block_mm(*c[:4], torch.float32) for c in cases]
    ok: list[str] = []
    names = ("triton", "scaled_mm", "decode", "decode_ticket", "decode_narrow") + (("stream",) if STREAM else ())
    for name in names:
        if name == "scaled_mm":  # the K cuBLAS does not take go to the checked fallback
            _FALLBACK[device.index or 0] = "triton" if ok else "emulated"
        try:
            for c, ref in zip(cases, refs):
                for out in _run_case(name, c):
                    torch.cuda.synchronize(device)
                    if not _agrees(out.float(), ref):
                        raise ValueError(f"wrong product at M={c[0].shape[0]}, N={c[2].shape[0]}, "
                                         f"K={c[0].shape[1]} (max diff "
                                         f"{(out.float() - ref).abs().max().item():.3g})")
            ok.append(name)
        except Exception as e:  # noqa: BLE001 - unsupported by this torch/cuBLAS/Triton, or wrong
            log.warning("fp8 blockwise GEMM %s not used: %s", name, str(e).splitlines()[0][:200])
    # An option that failed is dropped from every config (parts summed by the second kernel,
    # all rows quantized), not the decode kernel.
    _FAILED[device.index or 0] = {o for o in ("ticket", "narrow") if f"decode_{o}" not in ok}
    ok = [n for n in ok if n in ("triton", "scaled_mm", "decode", "stream")]
    return sorted(ok, key=lambda n: (n != "scaled_mm", n in _DECODE_ONLY))


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


def _faster_at_decode(device: torch.device, names: list[str]) -> dict[int, str]:
    """Per decode M bucket, the fastest of the correct GEMMs on four 4096 x 4096 weights in
    turn (64 MB: more than L2 holds, as a model's layers are)."""
    ws = [torch.randn(4096, 4096, device=device).to(torch.float8_e4m3fn) for _ in range(4)]
    sw = torch.full((32, 32), 1e-3, device=device)
    best = {}
    for m in DECODE_BUCKETS:
        x = torch.randn(m, 4096, device=device, dtype=torch.bfloat16)
        ms = {n: _replay_ms(lambda n=n: [fp8_block_linear(x, w, sw, n) for w in ws], device)
              for n in names}
        log.info("fp8 blockwise GEMM at M=%d: %s", m,
                 ", ".join(f"{n} {t * 1e3 / len(ws):.1f} us" for n, t in ms.items()))
        best[m] = min(ms, key=ms.__getitem__)
    return best


def block_backend(device: torch.device, m: int | None = None) -> str:
    """'scaled_mm' | 'triton' | 'decode' | 'stream' | 'emulated' for this CUDA device, and for `m` rows
    when given (at most DECODE_M: the fastest correct one for m's bucket). Probed once, on
    operands that show a wrong scale layout; a fallback from cuBLAS is announced with a warning."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _BACKEND:
        dev = torch.device("cuda", idx)
        ok = _probe(dev) or ["emulated"]
        small = _faster_at_decode(dev, ok) if len(ok) > 1 else dict.fromkeys(DECODE_BUCKETS, ok[0])
        _BACKEND[idx], _SMALL[idx] = ok[0], small
        _ROWS[idx] = _probe_rows(dev) if ok[0] != "emulated" else "emulated"
        level = logging.INFO if ok[0] == "scaled_mm" else logging.WARNING
        log.log(level, "fp8 blockwise GEMM on cuda:%d: %s (decode M buckets: %s; weight gradient: %s)%s",
                idx, ok[0], small, _ROWS[idx],
                "" if ok[0] != "emulated" else "; dequantized bf16 GEMMs: slow")
    if m is not None and m <= DECODE_M:
        return _SMALL[idx][next(b for b in DECODE_BUCKETS if m <= b)]
    return _BACKEND[idx]


_DECODE_ONLY = ("decode", "stream")  # GEMMs for decode M whose N must be whole 128-row tiles


def _stream_fits(w: torch.Tensor) -> bool:
    return w.shape[0] % TILE == 0 and w.shape[1] % TILE == 0


def fp8_block_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                     backend: str | None = None, unsummed: bool = False) -> torch.Tensor | SplitSum:
    """x [..., K] (bf16/fp16/fp32) times fp8 weight w [N, K] with 128x128 scales sw.
    `unsummed` (x 2-D): the decode GEMM's split-K parts may come back unsummed (a SplitSum)."""
    shape = x.shape
    m = x.numel() // shape[-1]
    backend = backend or block_backend(x.device, m)
    x2 = x.reshape(-1, shape[-1]).contiguous()
    if backend == "decode" and w.shape[0] % TILE == 0:
        if unsummed and x.dim() == 2:
            return decode_block_mm(x2, w, sw, x.dtype, unsummed=True)
        return decode_block_mm(x2, w, sw, x.dtype).reshape(*shape[:-1], w.shape[0])
    if backend == "stream" and _stream_fits(w):
        a = quantize_rows_fp8(x2)
        return stream_mm(a.values, w, x.dtype, sx=a.scales, sw=sw, m=m).reshape(*shape[:-1], w.shape[0])
    if backend in _DECODE_ONLY:  # N (or K) not whole tiles: the GEMM for any M
        backend = block_backend(x.device)
    pad = 4 if backend == "scaled_mm" else 1
    xq, sx = quantize_act_1x128(x2, pad)
    fn = {"scaled_mm": scaled_mm_block, "triton": triton_block_mm,
          "emulated": emulated_block_mm}[backend]
    return fn(xq, sx, w, sw, x.dtype)[:m].reshape(*shape[:-1], w.shape[0])


def fp8_act_linear(a: Fp8Act, w: torch.Tensor, sw: torch.Tensor,
                   backend: str | None = None, unsummed: bool = False) -> torch.Tensor | SplitSum:
    """fp8_block_linear of an activation quantized where it was made (an Fp8Act: the bits
    quantize_act_1x128(x, 4) gives, rows padded to 4) -> [a.rows, N] in a.dtype: the same GEMM
    for the same M and the same values, without the quantize launch (`unsummed`: as
    fp8_block_linear's)."""
    m, dev = a.rows, a.values.device
    backend = backend or block_backend(dev, m)
    if backend == "decode" and w.shape[0] % TILE == 0:
        return decode_block_mm_quantized(a.values, a.scales, m, w, sw, a.dtype, unsummed=unsummed)
    if backend == "stream" and _stream_fits(w):
        return stream_mm(a.values, w, a.dtype, sx=a.scales, sw=sw, m=m)
    if backend in _DECODE_ONLY:  # N (or K) not whole tiles: the GEMM for any M
        backend = block_backend(dev)
    if backend == "scaled_mm":  # takes the padded rows as they are (M-major scales, Mp % 4 == 0)
        return scaled_mm_block(a.values, a.scales, w, sw, a.dtype)[:m]
    fn = {"triton": triton_block_mm, "emulated": emulated_block_mm}[backend]
    return fn(a.values[:m], a.scales[:m], w, sw, a.dtype)


def fp8_static_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                      scale: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """x [..., K] times fp8 weight w [N, K] (128x128 scales sw), x quantized under a static
    per-tensor `scale` (0: its own 1x128 blocks; lowprec/delayed.py `quantize_input_blocks`):
    the block-scaled GEMMs with every block scale equal (static_block_mm)."""
    from milepost.lowprec.delayed import quantize_input_blocks

    shape = x.shape
    xq, sx = quantize_input_blocks(x.reshape(-1, shape[-1]), scale)
    return static_block_mm(xq, sx, w, sw, x.dtype, backend).reshape(*shape[:-1], w.shape[0])


def static_block_mm(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype, backend: str | None = None) -> torch.Tensor:
    """xq [M, K] fp8 with block scales sx [M, K/128] (any strides) times w [N, K] (128x128
    scales sw) -> [M, N]: the static engines' and the delayed trainer's GEMM. The decode kernel
    quantizes per block itself, so decode M takes the Triton GEMM where it passed the probe."""
    m = xq.shape[0]
    backend = backend or block_backend(xq.device, m)
    if backend == "stream" and _stream_fits(w):
        return stream_mm(xq, w, out_dtype, sx=sx, sw=sw, m=m)
    if backend in _DECODE_ONLY:
        fallback = _FALLBACK.get(xq.device.index or 0)
        backend = "triton" if fallback == "triton" else block_backend(xq.device)
    fn = {"scaled_mm": scaled_mm_block, "triton": triton_block_mm,
          "emulated": emulated_block_mm}[backend]
    return fn(xq, sx, w, sw, out_dtype)[:m]
