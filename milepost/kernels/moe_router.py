"""The end of an MoE router in one kernel for GPU inference: top-k weights renormalized, cast to
the model dtype, and the expert ids recorded (routed experts), instead of four torch launches.

Values equal torch's `(w / s).to(dtype)` and `ids.to(int32)`: an IEEE division (div_rn) and
round-to-nearest casts; the sum s stays torch's own reduction (its order is torch's to choose).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _finish_kernel(W, S, IDS, OUT_W, REC, stride_rec, n, K: tl.constexpr, BLOCK: tl.constexpr,
                   NORM: tl.constexpr, RECORD: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat (token, slot) pairs
    mask = offs < n
    t = offs // K
    w = tl.load(W + offs, mask=mask, other=1.0)
    if NORM:
        w = tl.math.div_rn(w, tl.load(S + t, mask=mask, other=1.0))
    tl.store(OUT_W + offs, w.to(OUT_W.dtype.element_ty), mask=mask)
    if RECORD:
        ids = tl.load(IDS + offs, mask=mask, other=0)
        tl.store(REC + t * stride_rec + offs % K, ids.to(REC.dtype.element_ty), mask=mask)


def finish_routing(w: torch.Tensor, s: torch.Tensor | None, ids: torch.Tensor, dtype: torch.dtype,
                   record: torch.Tensor | None) -> torch.Tensor:
    """w: [T, k] fp32 top-k probabilities, s: [T, 1] their sums (None: no renormalization),
    ids: [T, k] int64 -> weights [T, k] in `dtype`; record ([T, k] int32 view, rows strided)
    gets the ids."""
    t, k = w.shape
    out = torch.empty((t, k), dtype=dtype, device=w.device)
    n = t * k
    if n == 0:
        return out
    w, ids = w.contiguous(), ids.contiguous()
    block = 1024
    rec = record if record is not None else ids
    if record is not None and (record.stride(1) != 1 or record.shape != (t, k)):
        raise ValueError(f"record must be [T={t}, k={k}] with contiguous rows; got {tuple(record.shape)}")
    _finish_kernel[(triton.cdiv(n, block),)](
        w, s if s is not None else w, ids, out, rec, rec.stride(0), n, K=k, BLOCK=block,
        NORM=s is not None, RECORD=record is not None)
    return out
