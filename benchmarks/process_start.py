"""What a `milepost serve` engine costs to start: a fresh interpreter (how the launcher and the
tests start one) against a fork of a parent that has already imported torch, transformers and
the engine, in turns (spawn, fork, spawn, fork ...) so both see the same machine load.

    python benchmarks/process_start.py [--pairs 4]

Prints, per start, the engine's own CPU seconds and the wall seconds until `/health` answers
200, then the medians. The forked engines are a measurement only: nothing in milepost forks an
engine (docs/testing.md, "Suite time", says why not yet). CPU only (a forked child must not use
CUDA initialized in its parent; this parent never initializes it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from milepost.launch.process import free_port


def serve_args(model: Path, port: int) -> list[str]:
    return ["serve", "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--max-total-tokens", "2048", "--log-level", "warning"]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_healthy(port: int, t0: float, limit_s: float = 300.0) -> float:
    while time.monotonic() - t0 < limit_s:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"the engine on port {port} was not healthy after {limit_s:.0f} s")


def spawned(model: Path) -> tuple[float, float]:
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "milepost", *serve_args(model, port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wall = wait_healthy(port, t0)
        return cpu_seconds(proc.pid), wall
    finally:
        proc.terminate()
        proc.wait()


def forked(model: Path) -> tuple[float, float]:
    port = free_port()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: the CLI's own entry point, with this process's imports done
        try:
            from milepost.cli import main

            main(serve_args(model, port))
        finally:
            os._exit(0)
    try:
        wall = wait_healthy(port, t0)
        return cpu_seconds(pid), wall
    finally:
        os.kill(pid, 15)
        os.waitpid(pid, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    args = parser.parse_args()
    t = time.process_time()
    import milepost.cli  # noqa: F401  (what the forked engines inherit)
    import milepost.engine.server  # noqa: F401
    import transformers  # noqa: F401
    print(f"parent's imports (torch, transformers, the engine): {time.process_time() - t:.2f} CPU-s")
    from milepost.testing.checkpoints import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint(Path(tmp) / "qwen3", "qwen3", seed=3)
        rows: dict[str, list[tuple[float, float]]] = {"spawned": [], "forked": []}
        for _ in range(args.pairs):
            for name, start in (("spawned", spawned), ("forked", forked)):
                cpu, wall = start(model)
                rows[name].append((cpu, wall))
                print(f"{name:8s} {cpu:5.2f} CPU-s {wall:5.2f} s to healthy (load {os.getloadavg()[0]:.1f})",
                      flush=True)
        for name, r in rows.items():
            print(f"median {name}: {statistics.median(c for c, _ in r):.2f} CPU-s, "
                  f"{statistics.median(w for _, w in r):.2f} s to healthy")


if __name__ == "__main__":
    main()
