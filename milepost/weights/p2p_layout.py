"""The peer-to-peer transfer plan and the packed-bucket layout both ends of a write agree on.

- `transfer_plan` (report 4.2): which targets (engines) each source (trainer rank) writes to.
- `flat_layout` / `unpack`: a bucket travels as one uint8 buffer, every tensor starting on a
  64-byte boundary; sender and receiver compute the same offsets from names, shapes and dtypes.
- `StagingBuffer`: the one buffer a source packs each bucket into, reused for every target.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from milepost.weights.bucket import BucketMeta, Named

ALIGN = 64  # every tensor starts on a 64-byte boundary of the flat buffer (dtype views need it)


def transfer_plan(num_sources: int, num_targets: int) -> list[list[int]]:
    """targets of each source: plan[s] = target indices source s writes to.

    The first min(sources, targets) map one to one; the rest of the targets are spread evenly
    over the sources in turn. Surplus sources get an empty list (they sit idle).
    """
    if num_sources < 1 or num_targets < 0:
        raise ValueError(f"transfer_plan needs >= 1 source and >= 0 targets, got "
                         f"{num_sources} and {num_targets}")
    plan: list[list[int]] = [[] for _ in range(num_sources)]
    for t in range(num_targets):
        plan[t % num_sources].append(t)
    return plan


def flat_layout(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
                ) -> tuple[list[int], int]:
    """(byte offset of each tensor, total bytes) in the packed bucket; both ends compute it."""
    offsets, pos = [], 0
    for shape, dtype in zip(shapes, dtypes):
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        numel = 1
        for d in shape:
            numel *= int(d)
        pos += numel * dtype.itemsize
    return offsets, pos


def unpack(flat: torch.Tensor, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]
           ) -> list[torch.Tensor]:
    """Views of each tensor inside the packed uint8 buffer `flat` (no copy)."""
    offsets, total = flat_layout(shapes, dtypes)
    if flat.numel() < total:
        raise ValueError(f"packed bucket holds {flat.numel()} bytes, the layout needs {total}")
    out = []
    for off, shape, dtype in zip(offsets, shapes, dtypes):
        n = 1
        for d in shape:
            n *= int(d)
        out.append(flat[off:off + n * dtype.itemsize].view(dtype).view(tuple(shape)))
    return out


class StagingBuffer:
    """One packed-bucket buffer, grown only when a bucket is larger than any before."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flat = torch.empty(0, dtype=torch.uint8, device=device)

    def pack(self, bucket: Named, meta: BucketMeta) -> int:
        dtypes = [t.dtype for _, t in bucket]
        offsets, total = flat_layout(meta.shapes, dtypes)
        if self.flat.numel() < total:
            pin = self.device.type == "cpu" and torch.cuda.is_available()
            self.flat = torch.empty(total, dtype=torch.uint8, device=self.device, pin_memory=pin)
        for off, (_, t) in zip(offsets, bucket):
            n = t.numel() * t.element_size()
            if not n:
                continue
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if self.flat.device.type == "cpu" and src.device.type == "cpu":
                # A plain memcpy: torch's copy_ splits over its OpenMP threads, whose barrier
                # costs ~1000x the copy on a host whose cores are busy (measured here).
                np.copyto(self.flat[off:off + n].numpy(), src.numpy())
            else:
                self.flat[off:off + n].copy_(src)
        return total
