"""The Ray actor that hosts one component (an engine, the router or a trainer rank) on its node.

The actor starts the same command the local launcher would start, as its own child process (tied
to the actor: when Ray kills the actor, the child dies too), on the node's address rather than
loopback. Its output goes to a node-local file that the driver reads in chunks (`poll`) and
appends to run_dir/logs, so a component's log reaches the driver whichever node it ran on.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import httpx

from milepost.http_tls import tls_context
from milepost.launch.process import OPENMP_DEFAULTS, die_with_parent, free_port

LOG_CHUNK_BYTES = 1 << 20  # the most one poll returns; the rest comes with the next


class ComponentHost:
    """Wrapped with `ray.remote(...)` by the launcher; one per component."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.health_url: str | None = None
        self.ready = False
        fd, path = tempfile.mkstemp(prefix=f"milepost-{name.replace(' ', '-')}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)

    def node(self) -> tuple[str, str]:
        """(this node's IP address as Ray knows it, its Ray node id)."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def check_paths(self, paths: list[str]) -> list[str]:
        """The paths this node cannot see (run_dir and the model must be on a shared filesystem)."""
        return [p for p in paths if not Path(p).exists()]

    def start(self, cmd: list[str], env: dict[str, str], health_url: str | None) -> int:
        """Start the component; its pid. The environment is the actor's (Ray's CUDA_VISIBLE_DEVICES
        for the GPUs it was given) plus `env`."""
        self.health_url, self.ready = health_url, health_url is None
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**OPENMP_DEFAULTS, **os.environ, **env},
                                         preexec_fn=die_with_parent())  # noqa: PLW1509 (prctl only)
        return self.proc.pid

    def poll(self, offset: int) -> tuple[int | None, bool, bytes]:
        """(exit code or None while running, healthy yet, log bytes from `offset`)."""
        code = None if self.proc is None else self.proc.poll()
        if not self.ready and code is None and self.health_url:
            try:
                self.ready = httpx.get(self.health_url, timeout=2,
                                       verify=tls_context()).status_code == 200
            except httpx.HTTPError:
                pass
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            chunk = f.read(LOG_CHUNK_BYTES)
        return code, self.ready, chunk

    def stop(self, grace_s: float = 20.0) -> int | None:
        """Terminate the component (kill after grace_s); its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def remove_log(self) -> None:
        self.log_path.unlink(missing_ok=True)
