"""Resident host memory of this process, to measure that disk offload keeps host memory bounded.

Linux /proc only (no psutil dependency): VmRSS is the resident set now, VmHWM its peak. Writing
"5" to /proc/self/clear_refs resets the peak to the current value, so the highest point reached
during one call is read exactly afterwards, with no sampling thread that could miss a spike. Pinned memory (CUDA's host allocator) is also read from
torch's own statistics, since whether the kernel counts driver-pinned pages in VmRSS depends on
how the driver maps them.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class PeakGrowth(Generic[T]):
    result: T
    peak_growth_bytes: int  # highest resident set during the call minus the resident set before it
    seconds: float
    pinned_peak_growth_bytes: int | None = None  # the same for torch's pinned host pool; None: no CUDA


def _status_bytes(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{_STATUS} has no {key} line: measuring host memory needs Linux /proc")


def rss_bytes() -> int:
    """The process's resident set size now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_rss_growth(fn: Callable[[], T]) -> PeakGrowth[T]:
    """Run fn; how far above its starting point the resident set rose at its highest (VmHWM).

    The C heap is trimmed first: memory freed earlier but still resident would otherwise be
    reused by fn's allocations without raising the resident set, hiding them.
    """
    _trim_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # peak := current
    except OSError as e:
        raise RuntimeError(f"cannot reset the peak resident set through /proc/self/clear_refs ({e}); "
                           "host memory growth cannot be measured on this system") from e
    pinned_start = _pinned_start()
    start = rss_bytes()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    pinned_peak = None if pinned_start is None else _pinned_stat("peak")
    pinned = None if pinned_peak is None else max(0, pinned_peak - pinned_start)
    return PeakGrowth(result, max(0, _status_bytes("VmHWM") - start), seconds, pinned)


def _trim_heap() -> None:
    """glibc's malloc_trim(0): hand free heap pages back to the kernel (no-op elsewhere)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _pinned_stat(kind: str) -> int | None:
    """Bytes of pinned blocks torch's host allocator owns (handed out or cached); None: unknown."""
    import torch

    value = torch.cuda.host_memory_stats().get(f"allocated_bytes.{kind}")
    return None if value is None else int(value)


def _pinned_start() -> int | None:
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()
            and hasattr(torch.cuda, "reset_peak_host_memory_stats")):
        return None
    torch.cuda.reset_peak_host_memory_stats()
    return _pinned_stat("current")
