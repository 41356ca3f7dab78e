"""The MoE router after its gate GEMM, in Triton kernels for GPU inference.

`finish_routing`: the end after torch's softmax and top-k: top-k weights renormalized, cast to the
model dtype, and the expert ids recorded (routed experts), instead of four torch launches. Values
equal torch's `(w / s).to(dtype)` and `ids.to(int32)`: an IEEE division (div_rn) and
round-to-nearest casts; the sum s stays torch's own reduction (its order is torch's to choose).

`route`: the whole router in one kernel (fp32 softmax, top-k, renormalization, cast, record)
instead of six launches. The softmax follows torch's warp softmax for rows of up to 1,024
(`PersistentSoftmax.cuh`'s order: lane l sums columns l, l + 32, ... in turn, then the lanes
pair up as its xor butterfly does; libdevice's expf; an IEEE division), so the probabilities
are torch's bits wherever that kernel is the one torch runs. Top-k takes the largest first,
ties to the lowest expert id (torch leaves the order of ties unspecified), and the top-k sum
adds slots in order (torch's reduction may order it otherwise: the weights can differ from
the torch path's in the last bit).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

MAX_EXPERTS = 1024  # torch's warp softmax covers rows up to this; longer rows take the torch path


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


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    """expf as CUDA's libm computes it (torch's std::exp); tl.exp is the approximate ex2 form.
    Triton's interpreter has no libdevice: numpy's exp there."""
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _route_kernel(LOGITS, stride_l, OUT_W, IDS, REC, stride_rec, T, E: tl.constexpr,
                  LANES: tl.constexpr, LOG_LANES: tl.constexpr, ITERS: tl.constexpr, K: tl.constexpr,
                  K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr, RECORD: tl.constexpr,
                  LIBDEVICE_EXP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = (rows < T)[:, None]
    lanes = tl.arange(0, LANES)
    base = LOGITS + rows[:, None] * stride_l
    # torch's warp softmax: lane l holds columns l, l + LANES, ...; max in any order (exact)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for it in tl.static_range(ITERS):
        col = (it * LANES + lanes)[None, :]
        x = tl.load(base + col, mask=live & (col < E), other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(tl.where(live, x, 0.0), axis=1))
    # each lane sums its columns in order, then the lanes pair up as the warp's xor butterfly does
    s = tl.zeros([BLOCK_T, LANES], dtype=tl.float32)
    for it in tl.static_range(ITERS):
        col = (it * LANES + lanes)[None, :]
        x = tl.load(base + col, mask=live & (col < E), other=float("-inf")).to(tl.float32)
        s += _exp(tl.where(live, x, 0.0) - m[:, None], LIBDEVICE_EXP)
    for r in tl.static_range(LOG_LANES):  # [BLOCK_T, LANES] -> [BLOCK_T, 1]
        s = tl.sum(tl.reshape(s, [BLOCK_T, 2, LANES >> (r + 1)]), axis=1)
    total = tl.reshape(s, [BLOCK_T])
    cols = tl.arange(0, LANES * ITERS)[None, :]
    x = tl.load(base + cols, mask=live & (cols < E), other=float("-inf")).to(tl.float32)
    p = tl.math.div_rn(_exp(tl.where(live, x, 0.0) - m[:, None], LIBDEVICE_EXP), total[:, None])
    p = tl.where(cols < E, p, -1.0)  # padding columns are never chosen
    # top-k: the largest probability first, ties to the lowest expert id
    slot = tl.arange(0, K_PAD)[None, :]
    w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    wsum = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(p, axis=1)
        pick = tl.min(tl.where(p == best[:, None], cols, LANES * ITERS), axis=1)
        pick = tl.minimum(pick, E - 1)  # NaN logits match nothing: keep the id in range
        w = tl.where(slot == j, best[:, None], w)
        ids = tl.where(slot == j, pick[:, None], ids)
        wsum += best
        p = tl.where(cols == pick[:, None], -2.0, p)
    if NORM:
        w = tl.math.div_rn(w, wsum[:, None])
    out = rows[:, None] * K + slot
    keep = live & (slot < K)
    tl.store(OUT_W + out, w.to(OUT_W.dtype.element_ty), mask=keep)
    tl.store(IDS + out, ids.to(IDS.dtype.element_ty), mask=keep)
    if RECORD:
        tl.store(REC + rows[:, None] * stride_rec + slot, ids.to(REC.dtype.element_ty), mask=keep)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype,
          record: torch.Tensor | None, block_t: int | None = None, num_warps: int | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] gate output (any float dtype, E <= MAX_EXPERTS) -> (weights [T, k] in
    `dtype`, ids [T, k] int64); record ([T, k] int32 view, rows strided) gets the ids.
    block_t / num_warps: rows per program and warps (defaults: 256 // E rows, one warp up to 256
    experts; benchmarks/moe_router_gpu.py sweeps them)."""
    t, e = logits.shape
    if e > MAX_EXPERTS or top_k > e:
        raise ValueError(f"route: {e} experts, top-{top_k}: needs top_k <= experts <= {MAX_EXPERTS}")
    if record is not None and (record.stride(1) != 1 or record.shape != (t, top_k)):
        raise ValueError(f"record must be [T={t}, k={top_k}] with contiguous rows; got {tuple(record.shape)}")
    w = torch.empty((t, top_k), dtype=dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t == 0:
        return w, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    e_pad = triton.next_power_of_2(e)
    lanes = min(e_pad, 32)
    block_t = block_t or max(1, 256 // e_pad)
    rec = record if record is not None else ids
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, logits.stride(0), w, ids, rec, rec.stride(0), t, E=e, LANES=lanes,
        LOG_LANES=lanes.bit_length() - 1, ITERS=e_pad // lanes,
        K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_T=block_t, NORM=renormalize,
        RECORD=record is not None, LIBDEVICE_EXP=os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=num_warps or (1 if e_pad <= 256 else 4))
    return w, ids
