"""A fresh, isolated terminal per episode, built with bubblewrap (Debian's `bubblewrap`).

Inside: the host's /usr (read-only), a private writable /workspace (a temp directory deleted at
close), a private /tmp, no network (all namespaces unshared), no host environment, resource
limits (address space, processes, file size, CPU seconds) and a wall-clock limit per command.
If bubblewrap is missing or the machine forbids user namespaces, `Sandbox` refuses to start,
unless `allow_unsafe_no_sandbox=True` (then commands run as plain subprocesses in the temp
directory: NO isolation; for machines where you trust the model and the tasks).
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be had here; the message says why and names the unsafe switch."""


@dataclass(frozen=True)
class SandboxLimits:
    command_timeout_s: float = 10.0
    memory_bytes: int = 512 << 20
    max_processes: int = 64
    max_file_bytes: int = 16 << 20
    cpu_seconds: int = 10
    output_chars: int = 4000  # what a command's output may return to the model


@dataclass
class CommandResult:
    exit_code: int
    output: str  # stdout and stderr interleaved, truncated to limits.output_chars
    timed_out: bool = False


def _bwrap_base(workdir: Path) -> list[str]:
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
           "--bind", str(workdir), "/workspace", "--chdir", "/workspace",
           "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/workspace",
           "--setenv", "LANG", "C.UTF-8"]
    for link in ("bin", "lib", "lib64", "sbin"):  # merged-/usr layouts: symlinks into /usr
        p = Path("/") / link
        if p.is_symlink():
            cmd += ["--symlink", str(p.readlink()), f"/{link}"]
        elif p.is_dir():
            cmd += ["--ro-bind", str(p), f"/{link}"]
    return cmd


def isolation_problem() -> str | None:
    """None when bubblewrap can build a sandbox here, else why not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (apt-get install -y bubblewrap)"
    with tempfile.TemporaryDirectory() as d:
        try:
            out = subprocess.run([*_bwrap_base(Path(d)), "true"], check=False,
                                 capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            return "bwrap did not answer within 20 s"
    if out.returncode != 0:
        return (f"bwrap cannot create namespaces here ({out.stderr.strip()[:200]}); user "
                f"namespaces may be forbidden on this machine")
    return None


class Sandbox:
    """`with Sandbox(files={"a.txt": "..."}) as box: box.run("wc -l a.txt")`."""

    def __init__(self, files: dict[str, str] | None = None, *,
                 limits: SandboxLimits | None = None, allow_unsafe_no_sandbox: bool = False,
                 ) -> None:
        self.limits = limits or SandboxLimits()
        problem = isolation_problem()
        if problem is not None and not allow_unsafe_no_sandbox:
            raise SandboxUnavailable(
                f"terminal environment: {problem}. It refuses to run model commands without "
                f"isolation; pass allow_unsafe_no_sandbox=True (--allow-unsafe-no-sandbox) only "
                f"if you accept commands running unisolated on this machine")
        self.isolated = problem is None
        self.workdir = Path(tempfile.mkdtemp(prefix="milepost-sandbox-"))
        for rel, content in (files or {}).items():
            path = (self.workdir / rel).resolve()
            if self.workdir.resolve() not in path.parents:
                raise ValueError(f"sandbox file {rel!r} is outside the workspace")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)

    def _limit(self) -> None:  # runs in the child before exec
        lim = self.limits
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim.max_processes, lim.max_processes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.max_file_bytes, lim.max_file_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_seconds, lim.cpu_seconds))

    def run(self, command: str) -> CommandResult:
        argv = ([*_bwrap_base(self.workdir), "/bin/sh", "-c", command] if self.isolated
                else ["/bin/sh", "-c", command])
        try:
            out = subprocess.run(argv, check=False, cwd=self.workdir, capture_output=True,
                                 text=True, errors="replace", timeout=self.limits.command_timeout_s,
                                 preexec_fn=self._limit, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            text = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                    else (e.stdout or ""))
            return CommandResult(124, text[-self.limits.output_chars:] +
                                 f"\n[killed after {self.limits.command_timeout_s:.0f} s]", True)
        text = (out.stdout + out.stderr)[-self.limits.output_chars:]
        return CommandResult(out.returncode, text)

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
