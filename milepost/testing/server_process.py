"""Start a real `milepost serve` process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from milepost.launch.process import ComponentStartError, ManagedProcess, free_port

__all__ = ["ServerProcess", "free_port"]


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
