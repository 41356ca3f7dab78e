"""`milepost serve` for tests, forked from the preloaded server of `run_ranks` instead of a fresh
interpreter: the engine skips importing torch, transformers and itself (5.8 -> 0.9 CPU-s, 8.0 ->
1.2 s to healthy on the 2-core VM, benchmarks/process_start.py).

Still a process of its own serving real HTTP: it gets the caller's environment, working
directory and sys.path as a fresh `python -m milepost serve` would, writes stdout and stderr
to the server's log, exits through the CLI's own exit code (a signal shows as a negative
return code, as with Popen), and is stopped with SIGTERM / SIGKILL. Two differences remain,
which no test of a `ServerProcess` reads: /proc/PID/cmdline is the fork server's, and the
resident memory starts with the pages shared with it. CPU only (CUDA is never initialized in
the fork server, but a GPU test keeps its fresh interpreter anyway).
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import milepost


@functools.cache
def _interpreter_path() -> tuple[str, ...]:
    """sys.path entries a fresh interpreter adds itself (standard library, site-packages, .pth
    files), asked of one with no PYTHONPATH; once per process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", "import sys; print(repr(sys.path[1:]))"],
                         env=env, capture_output=True, text=True, check=True)
    return tuple(ast.literal_eval(out.stdout))


def _fresh_sys_path(env: dict[str, str], cwd: str, own: Sequence[str]) -> list[str]:
    """sys.path of `python -m ...` started in `cwd` with `env`: the working directory, then
    PYTHONPATH, then the interpreter's own entries (not pytest's additions to this process's)."""
    extra = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [cwd, *extra, *own]


def _serve(argv: list[str], env: dict[str, str], cwd: str, log_path: str, own_path: tuple[str, ...]) -> None:
    """The child: become `python -m milepost serve ARGV` with this environment and log."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = _fresh_sys_path(env, cwd, own_path)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [str(Path(milepost.__file__).with_name("__main__.py")), *argv]
    from milepost.cli import main

    sys.exit(main(argv))  # multiprocessing turns SystemExit into the exit code


class ForkedServer:
    """The part of `subprocess.Popen` that `ManagedProcess` and the tests use, for a server
    forked by multiprocessing's forkserver (which reaps it and reports its exit code)."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        from milepost.testing.dist import _context

        args = list(cmd)
        if args[1:4] != ["-m", "milepost", "serve"]:
            raise ValueError(f"ForkedServer starts `python -m milepost serve ...` only, not {args[:4]}")
        self.args = args
        # daemon: a server a test forgot to close is stopped when the test process exits
        # (multiprocessing would otherwise wait for it there, for ever).
        self._proc = _context("gloo").Process(
            target=_serve, args=(args[3:], env, os.getcwd(), str(log_path), _interpreter_path()), daemon=True)
        self._proc.start()
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:  # never signal a reaped pid (it may be someone else's now)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._proc.terminate()

    def kill(self) -> None:
        self._proc.kill()

    def __repr__(self) -> str:
        return f"ForkedServer(pid={self.pid}, returncode={self.returncode})"


def fork_server(cmd: Sequence[str], env: dict[str, str], log_path: Path) -> Any:
    """A ForkedServer when that is safe here (CPU: no CUDA device, none asked for), else None."""
    import torch

    if "CUDA_VISIBLE_DEVICES" in env or torch.cuda.is_available():
        return None
    return ForkedServer(cmd, env, log_path)
