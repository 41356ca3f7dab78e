"""The per-token LoRA delta of one projection for a batch whose tokens use different adapters.

Two paths over the same stacked weights (A: [slots, r, in], B: [out, slots, r]; slots 1..S of the
pool, the base model has none; the A of projections fused in one linear share one tensor):
- `segment_delta`: one gathered pair of matmuls per adapter present (the reference; CPU default).
  It picks rows on the host, so it cannot be captured in a CUDA graph.
- `stacked_deltas`: dense matmuls over all slots at once (one for the A of every projection fused
  in the linear, one per projection for B), each token's rank block weighted by its adapter's
  scaling and the others by exact zeros; static shapes and no host syncs, so CUDA graphs capture
  it (the GPU default; SGLang's segmented GEMM does the same work in one kernel).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

KERNELS = ("segment", "stacked")


def segment_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  segments: Sequence[tuple[int, torch.Tensor, float]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(rows, delta [n, out])] for each (slot index, token rows, scaling) in `segments`."""
    out = []
    for index, rows, scale in segments:
        xs = x.index_select(0, rows)  # [n, in]
        delta = (xs @ a[index].T) @ b[:, index].T  # [n, r] then [n, out]
        out.append((rows, delta * scale))
    return out


def stacked_deltas(x: torch.Tensor, a: torch.Tensor, bs: Sequence[torch.Tensor],
                   weights: torch.Tensor) -> list[torch.Tensor]:
    """[delta_p [T, out_p]] for the P projections fused in one linear (q/k/v, gate/up; P = 1 else).

    x [T, in]; a [P, S, r, in] (every part's A, so one matmul serves them all); bs[p] [out_p, S, r];
    weights [T, S]: the scaling of each token's adapter in its slot's column, 0 elsewhere.
    """
    n_parts, s, r, d_in = a.shape
    h = x @ a.view(n_parts * s * r, d_in).T  # [T, P*S*r]: every adapter's rank space (S*r is small)
    h = h.view(-1, n_parts, s, r) * weights[:, None, :, None].to(h.dtype)
    # h[:, p] is [T, S, r] with unit strides inside: flattening it to [T, S*r] copies nothing.
    return [h[:, j].reshape(-1, s * r) @ b.view(b.shape[0], s * r).T for j, b in enumerate(bs)]
