"""A child process with a log file and an HTTP health check: engines, routers, servers.

Every component milepost starts is one of these, so starting, waiting for health, reporting a
failed start (with the log's tail) and stopping (terminate, then kill) are written once.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from milepost.http_tls import tls_context

_PR_SET_PDEATHSIG = 1

# libgomp (torch's CPU OpenMP runtime) lets idle threads spin after every parallel region. On a
# machine whose cores are shared, the spinners starve the thread everyone waits for: a demo-sized
# train step (2 threads) took 5.7-6.4 s instead of 0.13-0.19 s at load average 7-8 on 2 cores
# (benchmarks/RESULTS.md, "Tiny demo"). Children sleep instead, unless the caller chose otherwise.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def openmp_defaults(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The entries of OPENMP_DEFAULTS that `env` (default: this process's environment) lacks."""
    env = os.environ if env is None else env
    return {k: v for k, v in OPENMP_DEFAULTS.items() if k not in env}


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes a child die when the process that started it dies, even by
    SIGKILL (no cleanup code runs then, so `close()` cannot stop it). Linux only; None elsewhere.

    The signal fires when the *thread* that started the child exits: start such children from a
    thread that lives as long as they should (the launcher's main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return set_parent_death_signal


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Every port free_port has returned in this process: never handed out twice. The launcher picks
# an engine's port, starts it without waiting, and picks the trainer's MASTER_PORT while the
# engine has not bound yet; once the two were the same port (CI, 2026-12-06: the ranks' store
# clients reached the engine's HTTP server).
_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on host, chosen at random below the kernel's ephemeral range: a port
    the OS picks (bind to 0) can be handed to an outgoing connection before our server binds it
    (seen in CI under load: "address already in use"); one outside that range can be taken only
    by another explicit bind. Never one this process handed out before (its server may not have
    bound it yet). A race with other processes' binds remains until the server binds."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for attempt in range(65):
        port = rng.randrange(max(1024, low - 12000), low) if low > 2048 and attempt < 64 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port on {host}: 64 random ports below {low} and one from the OS were "
                  "taken or handed out already")


class ComponentStartError(RuntimeError):
    """A component did not become healthy; the message carries its log's tail."""


class ManagedProcess:
    """Start `cmd`, log to `log_path`, wait until `health_url` answers 200, stop on close().

    env: added to this process's environment (and to OPENMP_DEFAULTS, which both override).
    tied_to_parent: the child is killed if this process dies without closing it (see
    `die_with_parent`); the launcher sets it so no engine outlives a killed `milepost train`.
    wait: block until healthy (default). With wait=False the caller polls `poll_ready()` (so it
    can start other things meanwhile); `timeout_s` still counts from the start.
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        log_path: str | Path,
        health_url: str | None,
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300.0,
        tied_to_parent: bool = False,
        wait: bool = True,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.health_url = health_url
        self.ready = health_url is None
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._log = open(self.log_path, "ab")
        self.proc = self._start({**OPENMP_DEFAULTS, **os.environ, **(env or {})}, tied_to_parent)
        if wait:
            self.wait_ready()

    def _start(self, env: dict[str, str], tied_to_parent: bool) -> subprocess.Popen:
        """The child process (a subclass may start it another way, with Popen's interface)."""
        return subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=die_with_parent() if tied_to_parent else None,  # noqa: PLW1509 (prctl only)
        )

    def poll_ready(self) -> bool:
        """True once the health URL answered 200 (one quick check per call). Raises
        ComponentStartError (with the log's tail) if it exited or timed out before that."""
        if self.ready:
            return True
        if self.proc.poll() is not None:
            self._start_failed(f"exited with code {self.proc.returncode}")
        try:
            if httpx.get(self.health_url, timeout=2, verify=tls_context()).status_code == 200:
                self.ready = True
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > self._deadline:
            self._start_failed(f"not healthy after {self._timeout_s:.0f} s")
        return False

    def wait_ready(self) -> None:
        while not self.poll_ready():
            time.sleep(0.2)

    def _start_failed(self, why: str) -> None:
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
