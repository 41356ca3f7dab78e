"""Escape probes against the terminal sandbox (issue 19), each written so that it cannot harm
the host if the sandbox failed: a /proc/sys write puts back the value already there, core_pattern
is only tested for write access, floods are bounded and live in the sandbox's own tmpfs."""

from __future__ import annotations

import os
import re
import threading
import time

import psutil
import pytest

from milepost.envs import seccomp
from milepost.envs.sandbox import Sandbox, SandboxLimits, isolation_problem

pytestmark = pytest.mark.skipif(isolation_problem() is not None,
                                reason=f"no isolation here: {isolation_problem()}")

_SYSCALL = ("python3 -c 'import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
            "r = libc.syscall({nr}, 0, 0, 0, 0, 0); print(r, ctypes.get_errno())'")


# Forks up to 150 children that sleep (they die with the sandbox); prints how many started.
_FORK_150 = """python3 -c '
import os, time
n = 0
for _ in range(150):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(4)
        os._exit(0)
    n += 1
print(n)'"""


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _uids(p: psutil.Process) -> tuple[int, int] | None:
    try:  # the process may end between the scan and this read
        uids = p.uids()
    except psutil.Error:
        return None
    return uids.real, uids.effective


def test_an_unprivileged_user_without_capabilities() -> None:
    with Sandbox() as box:
        assert box.run("id -u").output.strip() == "1000"
        caps = dict(re.findall(r"^(Cap\w+):\s+(\w+)$", box.run("cat /proc/self/status").output,
                               re.MULTILINE))
        assert caps and all(int(v, 16) == 0 for v in caps.values()), caps
        assert box.run("unshare -U true").exit_code != 0  # no new user namespace
        # Seen from the host, the command's process is not root (bwrap nests user namespaces,
        # so the uid map inside does not show the host's uid: look from outside).
        seen: list[tuple[int, int]] = []
        result = []
        done = threading.Event()
        # 8 s: long enough to be seen by a host scan on a loaded machine (one scan took seconds)
        runner = threading.Thread(target=lambda: (result.append(box.run("sleep 8.217")), done.set()))
        runner.start()
        while not done.is_set() and not seen:
            seen = [ids for p in psutil.process_iter() if _cmdline(p) == ["sleep", "8.217"]
                    for ids in [_uids(p)] if ids is not None]
            time.sleep(0.05)
        runner.join()
        assert seen, f"the sandboxed sleep was never seen from the host; its run: {result}"
        assert all(0 not in ids for ids in seen), seen
        if os.geteuid() == 0:  # sandboxes at once do not share a uid (nor its process count)
            with Sandbox() as other:
                assert other.uid != box.uid and seen[0][0] == box.uid


def test_proc_sys_is_read_only() -> None:
    with open("/proc/sys/vm/swappiness") as f:
        current = f.read().strip()
    with Sandbox() as box:
        r = box.run(f"echo {current} > /proc/sys/vm/swappiness")  # the same value: harmless
        assert r.exit_code != 0 and "Read-only" in r.output, r
        assert box.run("test -w /proc/sys/kernel/core_pattern").exit_code != 0


@pytest.mark.skipif(os.geteuid() != 0, reason="as non-root the process limit counts all of this user's processes")
def test_process_limit_holds() -> None:
    limits = SandboxLimits(max_processes=32, command_timeout_s=20)
    with Sandbox(limits=limits) as box:
        r = box.run(_FORK_150)
        started = int(r.output.split()[-1])
        assert 0 < started < 32, r.output  # the limit, less the processes already there


def test_tmp_and_workspace_are_capped() -> None:
    limits = SandboxLimits(tmp_bytes=4 << 20, workspace_bytes=4 << 20, max_file_bytes=64 << 20,
                           command_timeout_s=20)
    with Sandbox(limits=limits) as box:
        r = box.run("head -c 50M /dev/zero > /tmp/x; wc -c < /tmp/x")
        assert "No space left" in r.output and int(r.output.split()[-1]) <= 4 << 20, r
        r = box.run("for i in $(seq 20); do head -c 1M /dev/zero > f$i || break; done; ls | wc -l")
        assert "No space left" in r.output, r
        on_host = sum(p.stat().st_size for p in box.workdir.rglob("*") if p.is_file())
        assert 0 < on_host <= 4 << 20


@pytest.mark.skipif(not seccomp.supported(), reason="the seccomp filter is x86-64 only")
@pytest.mark.parametrize("name", ["ptrace", "keyctl", "io_uring_setup", "bpf", "unshare"])
def test_seccomp_denies_kernel_routes(name: str) -> None:
    with Sandbox() as box:
        r = box.run(_SYSCALL.format(nr=seccomp.DENIED_X86_64[name]))
        assert r.exit_code == 0 and r.output.split() == ["-1", "1"], (name, r)  # EPERM
        # An allowed call still works (getpid: 39 on x86-64).
        assert int(box.run(_SYSCALL.format(nr=39)).output.split()[0]) > 0


def test_links_out_of_the_workspace_never_reach_the_host() -> None:
    with Sandbox() as box:
        r = box.run("ln -s /etc/shadow leak; ln -s ../../etc up; echo kept > keep")
        assert r.exit_code == 0, r
        assert (box.workdir / "keep").read_text() == "kept\n"
        assert not (box.workdir / "leak").exists() and not (box.workdir / "up").is_symlink()
        assert box.run("cat keep").output == "kept\n"  # the workspace carries on


def test_big_output_is_cut_to_its_tail_not_failed() -> None:
    with Sandbox() as box:
        r = box.run("seq 1 2000000; echo done; exit 3")  # ~15 MB of output
        assert r.exit_code == 3 and r.output.endswith("2000000\ndone\n")
        assert len(r.output) <= box.limits.output_chars


def test_a_uid_held_by_one_process_is_not_handed_out_by_another() -> None:
    """Sandboxes in different processes (two trainer ranks, two xdist workers) never share a host
    uid: the process limit is per uid, and one uid would let their commands signal each other."""
    import subprocess
    import sys

    from milepost.envs import sandbox

    uid, claim = sandbox._claim_uid()
    try:
        # The child starts its search exactly at our uid: it must step past it.
        child = ("import secrets, milepost.envs.sandbox as s\n"
                 f"secrets.randbelow = lambda n: {uid - sandbox._UID_BASE}\n"
                 "print(s._claim_uid()[0])")
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) != uid
        with Sandbox() as box:
            assert box.uid != uid
    finally:
        claim.close()
