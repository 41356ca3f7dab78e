"""Run a function on N real ranks (processes of their own on a free loopback port) and collect results.

For tests of distributed code: `run_ranks(fn, 2, *args)` calls `fn(rank, world_size, *args)` in
each process inside an initialized default process group (gloo; nccl with backend="nccl") and
returns the per-rank results (picklable; tensors are fine, sent as bytes). A failure on any rank
raises with that rank's traceback.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from milepost.launch.process import free_port  # below the ephemeral range (why: there)


def _load_per_core() -> float:
    """The 1-minute load average per core, at least 1 (how many times slower than idle)."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        return 1.0


# What every rank imports before its first line of work: ~3.3 CPU-seconds a process when each
# rank is a fresh interpreter, and dynamo (~0.7 s), which DTensor's constructor imports on first
# use. On CPU (gloo) ranks fork from a server that imported these once per calling process
# (multiprocessing's forkserver; a tiny FSDP step then costs a rank 0.25 CPU-s, not 4.3); CUDA
# must not be initialized in a forked child, so nccl ranks stay fresh interpreters ("spawn").
# The tests' `milepost serve` processes fork from the same server (milepost/testing/server_fork.py):
# transformers and the engine as well.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "milepost.train.fsdp",
           "transformers", "milepost.cli", "milepost.engine.server", "milepost.testing.server_fork"]


def _context(backend: str) -> Any:
    if backend == "nccl" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call only
    return ctx


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, results: Any, args: tuple,
    env: dict[str, str] | None = None,
) -> None:
    try:
        if env is not None:  # the caller's environment now, not the server's when it started
            os.environ.clear()
            os.environ.update(env)
        # One intra-op thread per rank: tiny test models gain nothing from more, and OpenMP workers
        # spinning against busy cores made a 5x64 matmul take 15 ms here.
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        try:
            # Plain bytes through the queue: shared-memory tensors would die with this process.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((rank, True, buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """`fn` must be importable by name (a module-level function): ranks are new processes, forked
    from a server that has torch imported (gloo) or spawned (nccl); each sees the caller's
    environment as it is at this call.

    backend "nccl" puts rank r on cuda:(r % device_count) before joining the group."""
    ctx = _context(backend)
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, backend, results, args, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    start, slowest = time.monotonic(), 1.0
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                # timeout_s is for an idle machine: on a loaded one the ranks get their share of
                # the cores, so the limit stretches with the load per core (the highest seen).
                slowest = max(slowest, _load_per_core())
                waited = time.monotonic() - start
                if waited > timeout_s * slowest:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise TimeoutError(f"ranks {missing} gave no result in {waited:.0f}s "
                                       f"({timeout_s}s x load per core {slowest:.1f})") from None
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if dead and results.empty():
                    time.sleep(1.0)  # a result put just before exiting may still be in the pipe
                    if results.empty():
                        raise RuntimeError(f"ranks {dead} exited (codes "
                                           f"{[procs[r].exitcode for r in dead]}) with no result")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [out[r] for r in range(world_size)]
