"""W8A8 FP8 with per-token activation and per-channel weight scales: the GEMM a compressed-tensors
"FP8-dynamic" checkpoint means (weights float8_e4m3fn with one float32 scale per output row,
activations quantized per token at run time, lowprec/quantize.py `quantize_fp8_per_token`).

On Hopper (compute capability 9.0+) `torch._scaled_mm` with rowwise scales (scale_a float32
[M, 1], scale_b float32 [1, N]) runs it in FP8, after a start-up probe that compares its product
with the emulated one (as kernels/fp8_gemm.py probes its block-scaled GEMMs); elsewhere, or where
the probe disagrees or fails, it is emulated with a warning: the activations quantized and
dequantized per token, the weight dequantized per row, the GEMM in the model dtype. The
quantized values are the format's either way, but the two products differ beyond accumulation
order: the native GEMM multiplies the FP8 values exactly and rounds once (to the output dtype),
the emulation rounds the dequantized operands to the model dtype first (up to 2^-8 relative
each). Per linear that is bf16-level; end to end it is not small on every model, since the
next layer's per-token re-quantization turns a bf16 ulp into whole FP8 steps (on the tiny
random model of tests/gpu/test_fp8_rowwise_cuda.py the first token's log-prob moves by up to
0.12 on CPU, 0.24 measured on an H100): tests compare the native GEMM per call against its own
semantics, not engines end to end against the emulation.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from milepost.lowprec.quantize import dequantize_fp8_per_token, quantize_fp8_per_token

log = logging.getLogger(__name__)

_BACKEND: dict[torch.device, str] = {}  # "scaled_mm" | "emulated", probed once per device
_WARNED: set[str] = set()


def emulated_rowwise_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = Q(x) W^T in x's dtype: x quantized per token and dequantized (rounded once to x's
    dtype), the weight `w` (float8 [N, K]) times its row scales `sw` ([N] or [N, 1]) in float32,
    rounded once to x's dtype (as the W8A16 row store's forward does)."""
    xq, sx = quantize_fp8_per_token(x)
    xd = dequantize_fp8_per_token(xq, sx).to(x.dtype)
    wd = (w.float() * sw.float().reshape(-1, 1)).to(x.dtype)
    return F.linear(xd, wd, bias)


def scaled_mm_rowwise(xq: torch.Tensor, sx: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] float8 with sx [M, 1] times w [N, K] float8 with sw [N] (or [N, 1]), on cuBLAS.
    cuBLAS wants K and N multiples of 16: M is padded to 16 rows here, N and K are checked by
    the caller (`rowwise_takes`)."""
    m = xq.shape[0]
    pad = -m % 16
    if pad:
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
        sx = F.pad(sx, (0, 0, 0, pad), value=1.0)
    out = torch._scaled_mm(xq, w.t(), scale_a=sx.float().contiguous(),
                           scale_b=sw.float().reshape(1, -1).contiguous(), out_dtype=out_dtype)
    return out[:m]


def rowwise_takes(w: torch.Tensor) -> bool:
    """Whether cuBLAS's rowwise FP8 GEMM takes this weight's shape (N, K multiples of 16)."""
    return w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0


def _agrees(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """bf16 output vs the float32 emulated product: per-row tolerance (rows differ in scale)."""
    tol = 1e-2 * ref.abs() + 1e-2 * ref.abs().amax(1, keepdim=True) + 1e-30
    return bool(torch.isfinite(out).all() and ((out - ref).abs() <= tol).all())


def _probe(device: torch.device) -> str:
    """scaled_mm where it gives the emulated product on operands whose token and channel scales
    differ by orders of magnitude (a scale read from the wrong place shows), else emulated."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "emulated"
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        for m, n, k in ((1, 384, 512), (5, 256, 640), (200, 384, 1024)):
            x = torch.randn(m, k, device=device, generator=gen) * torch.logspace(-2, 2, m, device=device)[:, None]
            w = torch.randn(n, k, device=device, generator=gen) * torch.logspace(-3, 0, n, device=device)[:, None]
            sw = (w.abs().amax(1) / 448.0).clamp(min=1e-12)
            wq = (w / sw[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            xq, sx = quantize_fp8_per_token(x.to(torch.bfloat16))
            ref = dequantize_fp8_per_token(xq, sx) @ (wq.float() * sw[:, None]).t()
            out = scaled_mm_rowwise(xq, sx, wq, sw, torch.bfloat16).float()
            torch.cuda.synchronize(device)
            if not _agrees(out, ref):
                log.warning("fp8 rowwise GEMM scaled_mm: wrong product (max diff %.3g); the "
                            "per-token x per-channel FP8 GEMM is emulated", (out - ref).abs().max().item())
                return "emulated"
    except Exception as e:  # noqa: BLE001 - unsupported by this torch / cuBLAS
        log.warning("fp8 rowwise GEMM scaled_mm not used (emulated instead): %s", str(e).splitlines()[0][:200])
        return "emulated"
    return "scaled_mm"


def rowwise_backend(device: torch.device) -> str:
    """"scaled_mm" or "emulated" for `device`, probed once (call at start, not inside a graph
    capture); a device without the native GEMM gets one warning."""
    if device not in _BACKEND:
        _BACKEND[device] = _probe(device) if device.type == "cuda" else "emulated"
        if _BACKEND[device] == "emulated" and str(device) not in _WARNED:
            _WARNED.add(str(device))
            cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
            log.warning("FP8-dynamic checkpoint (per-token FP8 activations): %s has no native "
                        "rowwise FP8 GEMM; emulated (quantize, dequantize, GEMM in the model "
                        "dtype): the format's values, not its speed",
                        f"compute capability {cap}" if cap else "the CPU")
    return _BACKEND[device]


def rowwise_linear(x: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = Q_token(x) · (w · sw)^T + bias, x [.., K] in the model dtype, w float8 [N, K], sw
    float32 [N] (or [N, 1]); native on a probed Hopper, else emulated (same values)."""
    if (x.device.type != "cuda" or x.dtype != torch.bfloat16 or not rowwise_takes(w)
            or rowwise_backend(x.device) != "scaled_mm"):
        return emulated_rowwise_linear(x, w, sw, bias)
    lead = x.shape[:-1]
    xq, sx = quantize_fp8_per_token(x.reshape(-1, x.shape[-1]))
    y = scaled_mm_rowwise(xq, sx, w, sw, x.dtype).reshape(*lead, w.shape[0])
    return y + bias if bias is not None else y
