"""Disk offload's host memory (issue 9): evicting through the disk holds no more host memory than
the staging buffer plus a small constant. On CPU the evicted state is itself host memory, so this
checks what can be checked here: the eviction makes no host copy besides the staging buffer (the
restore must re-allocate the freed state, whatever the destination, so only its upper bound is
checked). The host destination, which does copy, is the control that shows the meter sees a copy.
The device-side bound (offload and reload) is tests/gpu/test_train_cuda_host_memory.py."""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from milepost.train.host_memory import peak_rss_growth, rss_bytes
from milepost.train.offload import StateEvictor

CPU = torch.device("cpu")
MiB = 1 << 20
STATE_BYTES = 96 * MiB
STAGING = 4 * MiB
SLACK = 16 * MiB  # Python objects, file buffers, allocator rounding


def state() -> list[torch.Tensor]:
    """12 tensors of 8 MiB, each with distinct contents (so a wrong refill is visible)."""
    n = STATE_BYTES // 12 // 4
    return [torch.arange(n, dtype=torch.float32) * (i + 1) for i in range(12)]


def test_disk_eviction_stays_within_the_staging_buffer(tmp_path: Path) -> None:
    tensors = state()
    expected = [t.clone() for t in tensors]
    disk = StateEvictor("disk", CPU, directory=tmp_path, staging_bytes=STAGING)
    evict = peak_rss_growth(lambda: disk.evict(tensors)).peak_growth_bytes
    assert evict <= STAGING + SLACK, f"disk eviction raised RSS by {evict / MiB:.1f} MiB"
    restore = peak_rss_growth(disk.restore).peak_growth_bytes  # the freed state comes back
    assert restore <= STATE_BYTES + STAGING + SLACK, f"disk restore raised RSS by {restore / MiB:.1f} MiB"
    assert all(torch.equal(a, b) for a, b in zip(tensors, expected))
    del expected

    host = StateEvictor("host", CPU)  # the control: a full host copy must show up
    copied = peak_rss_growth(lambda: host.evict(tensors)).peak_growth_bytes
    assert copied >= 0.9 * STATE_BYTES, f"host eviction raised RSS by only {copied / MiB:.1f} MiB"
    host.restore()


def test_rss_is_read_from_proc() -> None:
    block = mmap.mmap(-1, 32 * MiB)  # a fresh mapping: its pages cannot be ones already resident
    before = rss_bytes()
    for off in range(0, 32 * MiB, 4096):
        block[off] = 1  # a touched page is resident
    assert rss_bytes() - before >= 30 * MiB
    block.close()
