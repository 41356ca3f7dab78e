"""The device's memory bandwidth as a plain copy reaches it, measured in the benchmark's own run.

A vendor's peak (args.PEAK_BANDWIDTH) is a datasheet figure no kernel reaches: on the H200 (4.8
TB/s by the datasheet) a device-to-device copy moved ~4.3 TB/s. The decode steps' bytes a second
are reported against both, so "x% of the bound" can be read against what this machine delivers
today, measured beside the numbers it judges.
"""

from __future__ import annotations

import time

import torch

CUDA_BYTES = 1 << 30  # 1 GiB a side: far past the L2 (50-60 MB on Hopper)
CPU_BYTES = 1 << 27  # 128 MiB: past the caches, a fraction of a second on 2 cores


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> float:
    """Bytes a second of `dst.copy_(src)` over nbytes, read and written both counted (as a copy
    benchmark counts them); the median of `reps` timed copies after two untimed ones."""
    nbytes = nbytes or (CUDA_BYTES if device.type == "cuda" else CPU_BYTES)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    dst = torch.empty_like(src)
    try:
        for _ in range(2):
            dst.copy_(src)
        times = []
        for _ in range(reps):
            times.append(_timed_copy(dst, src))
        times.sort()
        return 2 * nbytes / times[len(times) // 2]
    finally:
        del src, dst
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the engine sizes its KV pool from the free memory next


def _timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    if dst.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0
