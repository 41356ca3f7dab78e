"""A child process with a log file and an HTTP health check: engines, routers, servers.

Every component milepost starts is one of these, so starting, waiting for health, reporting a
failed start (with the log's tail) and stopping (terminate, then kill) are written once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on host (the OS picks it; a tiny race remains until it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ComponentStartError(RuntimeError):
    """A component did not become healthy; the message carries its log's tail."""


class ManagedProcess:
    """Start `cmd`, log to `log_path`, wait until `health_url` answers 200, stop on close()."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        log_path: str | Path,
        health_url: str | None,
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        if health_url is not None:
            self._wait_healthy(health_url, timeout_s)

    def _wait_healthy(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        why = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
               else f"not healthy after {timeout_s:.0f} s")
        self.close()
        raise ComponentStartError(f"{self.name} {why}; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n_chars:]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
