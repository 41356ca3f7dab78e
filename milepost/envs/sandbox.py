"""A fresh, isolated terminal per command, built with bubblewrap (Debian's `bubblewrap`).

Inside: the host's /usr (read-only), /workspace and /tmp on size-capped tmpfs mounts, no network
(all namespaces unshared), no host environment, an unprivileged user (uid 1000 inside; when
milepost runs as root, bubblewrap itself runs as a non-root uid of the sandbox's own, so the
process limit applies and nothing inside is host root), no capabilities, no further user namespaces, a
seccomp filter (milepost/envs/seccomp.py), /proc/sys read-only, resource limits (address space,
processes, file size, CPU seconds) and a wall-clock limit per command. The workspace persists
between commands as a host copy that goes in and comes back as a tar stream, so it never holds
more than the tmpfs did. If bubblewrap is missing or the machine forbids user namespaces,
`Sandbox` refuses to start, unless `allow_unsafe_no_sandbox=True` (then commands run as plain
subprocesses in the temp directory: NO isolation; for machines where you trust the model; as
root, they still run as the sandbox's own unprivileged uid under the same resource limits).
"""

from __future__ import annotations

import io
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from milepost.envs import seccomp

_INSIDE_UID = 1000
# Runs inside, as the sandbox user: restore the workspace from stdin, run the command keeping
# only its output's tail (any amount of output is fine), kill whatever it left running (kill -1
# spares this shell), then print "<exit code> <output bytes>\n", the tail and the workspace as a
# tar stream. Only this stream comes back, so nothing inside can write to the host.
_WRAPPER = """
tar -xf - -C /workspace --no-same-owner 2>/io/out || { echo '125 0'; exit 0; }
{ timeout -k 1 "$2" /bin/sh -c "$1" </dev/null 2>&1; echo $? >/io/rc; } | tail -c "$3" >/io/out
rc=$(cat /io/rc 2>/dev/null || echo 125)
kill -s KILL -- -1 2>/dev/null
echo "$rc $(wc -c </io/out)"
cat /io/out
tar -cf - -C /workspace .
"""


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
    workspace_bytes: int = 64 << 20  # tmpfs size of /workspace: the workspace's disk quota
    tmp_bytes: int = 64 << 20  # tmpfs size of /tmp (RAM: counts beside memory_bytes)
    output_bytes: int = 1 << 20  # tmpfs holding the tail of a command's output and its code
    # Host uid bubblewrap runs as when milepost runs as root; None = one of its own per Sandbox
    # (from 100000 up), so sandboxes running at once do not share one process count.
    sandbox_uid: int | None = None


@dataclass
class CommandResult:
    exit_code: int
    output: str  # stdout and stderr interleaved, truncated to limits.output_chars
    timed_out: bool = False


def _bwrap_base(limits: SandboxLimits) -> list[str]:
    cmd = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
           "--new-session", "--clearenv", "--uid", str(_INSIDE_UID), "--gid", str(_INSIDE_UID),
           "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr", "--proc", "/proc",
           "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev",
           "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
           "--size", str(limits.workspace_bytes), "--tmpfs", "/workspace",
           "--size", str(limits.output_bytes), "--tmpfs", "/io", "--chdir", "/workspace",
           "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/workspace",
           "--setenv", "LANG", "C.UTF-8"]
    for link in ("bin", "lib", "lib64", "sbin"):  # merged-/usr layouts: symlinks into /usr
        p = Path("/") / link
        if p.is_symlink():
            cmd += ["--symlink", str(p.readlink()), f"/{link}"]
        elif p.is_dir():
            cmd += ["--ro-bind", str(p), f"/{link}"]
    return cmd


_UID_BASE, _UID_COUNT = 100000, 60000


def _claim_uid() -> tuple[int, socket.socket]:
    """A host uid that no other live sandbox on this machine holds, in any process, and the claim
    (close it to release). The claim is an abstract Unix socket name: exclusive machine-wide, gone
    with its process, no files. (Counting from 100000 in each process handed two processes the same
    uids: the process limit, which is per uid, then counted the other's processes, and episodes of
    two trainers could signal each other's commands.)"""
    start = secrets.randbelow(_UID_COUNT)
    for i in range(_UID_COUNT):
        uid = _UID_BASE + (start + i) % _UID_COUNT
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"\0milepost-sandbox-uid-{uid}")
            return uid, claim
        except OSError:
            claim.close()
    raise RuntimeError(f"all {_UID_COUNT} sandbox uids from {_UID_BASE} are in use on this machine")


def _limited(argv: list[str], limits: SandboxLimits) -> list[str]:
    """`argv` under util-linux's `prlimit`: address space, processes, file size, CPU seconds.
    Not a `preexec_fn`: Python code in the forked child of a threaded process (the episode runs
    on a worker thread, beside torch's threads) can deadlock before exec; CI saw a child hang
    for good destroying a gloo process group's state inherited from the parent."""
    return ["prlimit", f"--as={limits.memory_bytes}", f"--nproc={limits.max_processes}",
            f"--fsize={limits.max_file_bytes}", f"--cpu={limits.cpu_seconds}", "--", *argv]


def _as_uid(uid: int) -> dict[str, object]:
    """Popen arguments that start the child as `uid` when milepost runs as root (root's process
    limit is not enforced, and root is root); set in C between fork and exec, no Python there."""
    return {"user": uid, "group": uid, "extra_groups": []} if os.geteuid() == 0 else {}


def _seccomp_fd() -> int | None:
    """A pipe's read end holding the filter program, or None where there is no filter."""
    if not seccomp.supported():
        return None
    r, w = os.pipe()
    os.write(w, seccomp.deny_list_program())  # a few hundred bytes: below any pipe buffer
    os.close(w)
    return r


def _launch(script_args: list[str], limits: SandboxLimits, uid: int, stdin_data: bytes,
            timeout_s: float) -> tuple[int | None, bytes, bytes]:
    """Run bwrap + the wrapper; (bwrap's exit code or None on timeout, stdout, stderr)."""
    fd = _seccomp_fd()
    argv = _bwrap_base(limits) + (["--seccomp", str(fd)] if fd is not None else [])
    try:
        proc = subprocess.Popen(_limited([*argv, *script_args], limits), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                                pass_fds=(fd,) if fd is not None else (), **_as_uid(uid))
    finally:
        if fd is not None:
            os.close(fd)
    # Far more than a workspace tar can be: anything bigger is a flood, not a workspace.
    cap = 4 * limits.workspace_bytes + 2 * limits.output_bytes + (1 << 20)
    out, err = bytearray(), bytearray()

    def read(stream: object, buf: bytearray) -> None:
        while chunk := stream.read(1 << 16):
            if len(buf) < cap:
                buf += chunk

    readers = [threading.Thread(target=read, args=(proc.stdout, out), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, err), daemon=True)]
    for t in readers:
        t.start()
    try:
        proc.stdin.write(stdin_data)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    for t in readers:
        t.join(timeout=10)
    return code, bytes(out), bytes(err)


def isolation_problem() -> str | None:
    """None when bubblewrap can build the sandbox here (as it will for commands), else why not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (apt-get install -y bubblewrap)"
    if shutil.which("prlimit") is None:
        return "prlimit (util-linux) is not installed: it sets each command's resource limits"
    for attempt in range(3):  # a busy machine can fail one start; a machine without isolation fails all
        uid, claim = _claim_uid()
        try:
            code, out, err = _launch(["/bin/sh", "-c", "id -u"], SandboxLimits(), uid, b"", 20.0)
        finally:
            claim.close()
        if code == 0 and out.strip() == str(_INSIDE_UID).encode():
            return None
        time.sleep(0.5 * (attempt + 1))
    if code is None:
        return "bwrap did not answer within 20 s"
    said = (err or out).decode(errors="replace").strip()[:200]
    return (f"bwrap cannot create the sandbox here (exit {code}: {said!r}); user namespaces may be "
            "forbidden on this machine")


def _inside_only(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """tarfile's "data" filter, but a member it refuses (a link out of the workspace, a device)
    is dropped rather than failing the whole save."""
    try:
        return tarfile.data_filter(member, dest)
    except tarfile.FilterError:
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
        self._uid_claim: socket.socket | None = None
        if self.limits.sandbox_uid is not None:
            self.uid = self.limits.sandbox_uid
        else:
            self.uid, self._uid_claim = _claim_uid()
        self.workdir = Path(tempfile.mkdtemp(prefix="milepost-sandbox-"))
        for rel, content in (files or {}).items():
            path = (self.workdir / rel).resolve()
            if self.workdir.resolve() not in path.parents:
                raise ValueError(f"sandbox file {rel!r} is outside the workspace")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        if not self.isolated and os.geteuid() == 0:  # the unprivileged uid works in its own copy
            for p in [self.workdir, *self.workdir.rglob("*")]:
                os.chown(p, self.uid, self.uid, follow_symlinks=False)

    def run(self, command: str) -> CommandResult:
        if not self.isolated:
            return self._run_unisolated(command)
        lim = self.limits
        start = time.monotonic()
        tail_bytes = 4 * lim.output_chars  # UTF-8: at most 4 bytes a character
        code, out, err = _launch(
            ["/bin/sh", "-c", _WRAPPER, "sh", command, f"{lim.command_timeout_s:g}",
             str(tail_bytes)], lim, self.uid, self._pack(), lim.command_timeout_s + 60)
        if code is None:
            return CommandResult(124, f"[sandbox killed after {time.monotonic() - start:.0f} s; "
                                 "the workspace is as it was before this command]", True)
        try:
            header, rest = out.split(b"\n", 1)
            rc, n = (int(x) for x in header.split())
            text, archive = rest[:n].decode(errors="replace"), rest[n:]
        except ValueError:
            why = err.decode(errors="replace").strip()[-300:]
            return CommandResult(125, f"[sandbox failed ({why or 'no answer'}); the workspace "
                                 "is as it was before this command]")
        timed_out = rc in (124, 137) and time.monotonic() - start >= lim.command_timeout_s
        if timed_out:
            text += f"\n[killed after {lim.command_timeout_s:.0f} s]"
        if not self._unpack(archive):
            text += "\n[the workspace could not be saved; it is as it was before this command]"
        return CommandResult(124 if timed_out else rc, text[-lim.output_chars:], timed_out)

    def _pack(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for child in sorted(self.workdir.iterdir()):
                tar.add(child, arcname=child.name)
        return buf.getvalue()

    def _unpack(self, archive: bytes) -> bool:
        """Replace the host copy with `archive` (links out, devices, absolute paths dropped)."""
        fresh = Path(tempfile.mkdtemp(prefix="milepost-sandbox-"))
        try:
            with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
                tar.extractall(fresh, filter=_inside_only)
        except (tarfile.TarError, OSError, ValueError):
            shutil.rmtree(fresh, ignore_errors=True)
            return False
        shutil.rmtree(self.workdir, ignore_errors=True)
        os.replace(fresh, self.workdir)
        return True

    def _run_unisolated(self, command: str) -> CommandResult:
        lim = self.limits
        argv = ["/bin/sh", "-c", command]
        if shutil.which("prlimit") is not None:
            argv = _limited(argv, lim)
        try:  # as root: as the sandbox's uid, so nothing it runs is host root
            out = subprocess.run(argv, check=False, cwd=self.workdir, capture_output=True,
                                 text=True, errors="replace", timeout=lim.command_timeout_s,
                                 stdin=subprocess.DEVNULL, **_as_uid(self.uid))
        except subprocess.TimeoutExpired as e:
            text = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                    else (e.stdout or ""))
            return CommandResult(124, text[-lim.output_chars:] +
                                 f"\n[killed after {lim.command_timeout_s:.0f} s]", True)
        return CommandResult(out.returncode, (out.stdout + out.stderr)[-lim.output_chars:])

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self._uid_claim is not None:
            self._uid_claim.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
