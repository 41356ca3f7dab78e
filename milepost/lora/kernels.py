"""The per-token LoRA delta of one projection for a batch whose tokens use different adapters.

Two paths over the same stacked weights (A: [slots, r, in], B: [out, slots, r]; slots 1..S of the
pool, the base model has none):
- `segment_delta`: one gathered pair of matmuls per adapter present (the reference; CPU default).
  It picks rows on the host, so it cannot be captured in a CUDA graph.
- `stacked_delta`: two dense matmuls over all slots at once, each token's rank block weighted by
  its adapter's scaling and the others by exact zeros; static shapes and no host syncs, so CUDA
  graphs capture it (the GPU default; SGLang's segmented GEMM does the same work in one kernel).
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


def stacked_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """delta [T, out]: x [T, in]; a [S, r, in]; b [out, S, r]; weights [T, S] (scaling or 0)."""
    s, r, d_in = a.shape
    h = x @ a.view(s * r, d_in).T  # [T, S*r]: every adapter's rank space (slots are few, r small)
    h = (h.view(-1, s, r) * weights.unsqueeze(-1).to(h.dtype)).view(-1, s * r)
    return h @ b.view(b.shape[0], s * r).T
