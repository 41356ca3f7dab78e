"""The sandboxed terminal environment: isolation, limits, cleanup, and the task set (each task's
test fails on the starting files and passes after its reference solution)."""

from __future__ import annotations

import os

import pytest

from milepost.envs.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    isolation_problem,
)
from milepost.envs.tasks import TASKS

needs_bwrap = pytest.mark.skipif(isolation_problem() is not None,
                                 reason=f"no isolation here: {isolation_problem()}")


@needs_bwrap
def test_sandbox_is_isolated_and_deleted_after() -> None:
    with Sandbox({"a.txt": "1\n2\n"}) as box:
        assert box.run("wc -l < a.txt").output.strip() == "2"
        assert box.run("echo x > /usr/evil").exit_code != 0  # host files are read-only
        assert "eth0" not in box.run("cat /proc/net/dev").output  # no network but loopback
        assert box.run("python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), 2)'"
                       ).exit_code != 0
        assert box.run("env").output.count("\n") <= 4  # no host environment
        workdir = box.workdir
        assert (workdir / "a.txt").is_file()
    assert not workdir.exists()


@needs_bwrap
def test_limits_stop_runaway_commands() -> None:
    with Sandbox(limits=SandboxLimits(command_timeout_s=2, max_file_bytes=1 << 20)) as box:
        r = box.run("sleep 20")
        assert r.timed_out and r.exit_code == 124
        assert box.run("head -c 5000000 /dev/zero > big").exit_code != 0


def test_refuses_without_isolation_unless_unsafe(monkeypatch) -> None:
    import milepost.envs.sandbox as sb

    monkeypatch.setattr(sb, "isolation_problem", lambda: "user namespaces are forbidden")
    with pytest.raises(SandboxUnavailable, match="allow_unsafe_no_sandbox"):
        Sandbox()
    with Sandbox({"f": "x"}, allow_unsafe_no_sandbox=True) as box:
        assert not box.isolated and box.run("cat f").output == "x"
        assert box.run("echo y > g && cat g").output == "y\n"
        if os.geteuid() == 0:  # unisolated, but as the sandbox's own uid: not host root
            assert box.run("id -u").output.strip() == str(box.uid) != "0"
            assert box.run("touch /etc/milepost-probe").exit_code != 0


@needs_bwrap
def test_every_task_is_graded_by_its_own_test() -> None:
    assert len(TASKS) >= 10 and len({t.name for t in TASKS}) == len(TASKS)
    for task in TASKS:
        with Sandbox(task.files) as box:
            assert box.run(task.test).exit_code != 0, f"{task.name}: start state passes"
            solved = box.run(task.solution)
            assert solved.exit_code == 0, (task.name, solved.output)
            assert box.run(task.test).exit_code == 0, f"{task.name}: solution fails its test"
