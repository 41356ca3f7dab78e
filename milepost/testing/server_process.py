"""Start a real `milepost serve` process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from milepost.launch.process import ComponentStartError, ManagedProcess, free_port

__all__ = ["ServerProcess", "free_port"]

# Tests turn this on (tests/conftest.py): on CPU, servers are forked from the preloaded server of
# `run_ranks` (milepost/testing/server_fork.py says what stays the same). Off for everyone else
# (`milepost check-family` starts its engine through this class).
FORK_FROM_PRELOADED = False


class ServerProcess(ManagedProcess):
    """`with ServerProcess(model_dir, "--max-total-tokens", "2048") as srv: httpx.post(srv.url...)`.

    Extra arguments are `milepost serve` flags; `env` adds environment variables (e.g.
    CUDA_VISIBLE_DEVICES to give the server its own GPU). Output goes to a log file whose tail is shown if
    the server fails to become healthy.
    """

    def __init__(self, model_path: str | Path, *flags: str, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "milepost", "serve", "--model-path", str(model_path),
               "--port", str(self.port), "--log-level", "warning", *flags]
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        try:
            super().__init__(f"milepost serve on port {self.port}", cmd,
                             Path(model_path) / f"server-{self.port}.log", f"{self.url}/health",
                             env=env, timeout_s=timeout_s)
        except ComponentStartError as e:
            raise RuntimeError(f"milepost serve did not become healthy: {e}") from e

    def _start(self, env: dict[str, str], tied_to_parent: bool) -> subprocess.Popen:
        if FORK_FROM_PRELOADED and not tied_to_parent:
            from milepost.testing.server_fork import fork_server

            forked = fork_server(self.cmd, env, self.log_path)
            if forked is not None:
                return forked
        return super()._start(env, tied_to_parent)
