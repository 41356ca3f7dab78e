"""The session's shared demo build (milepost/testing/demo_build.py): one process wins the build,
a failed build reaches every waiter with its log, and the build stops with its pytest session."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from milepost.testing.demo_build import SharedDemoBuild, main, session_root


def test_only_the_first_start_builds_and_a_failure_reaches_the_waiter(tmp_path: Path) -> None:
    # a refused option fails in a second, before torch loads: the path a broken build takes
    first = SharedDemoBuild(tmp_path, prepare_args=("--seed", "not-a-number"))
    assert first.start() is True
    assert SharedDemoBuild(tmp_path).start() is False  # another worker of the same session
    with pytest.raises(RuntimeError, match=r"exited 2(.|\n)*--seed"):
        SharedDemoBuild(tmp_path).wait(timeout_s=120, poll_s=0.1)


def test_a_build_without_an_exit_status_is_reported(tmp_path: Path) -> None:
    build = SharedDemoBuild(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "tiny-demo.pid").write_text(str(gone.pid))
    with pytest.raises(RuntimeError, match="died without an exit status"):
        build.wait(timeout_s=60, poll_s=0.05)
    with pytest.raises(TimeoutError, match="did not finish in 0s"):
        SharedDemoBuild(tmp_path / "none").wait(timeout_s=0, poll_s=0.05)


def test_the_build_stops_when_its_session_is_gone(tmp_path: Path) -> None:
    session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # the real build (minutes); it must be stopped by the watchdog within seconds
    build = subprocess.Popen([sys.executable, "-m", "milepost.testing.demo_build", str(tmp_path / "d"),
                              str(session.pid)])
    try:
        time.sleep(1.0)
        session.kill()
        session.wait()
        assert build.wait(timeout=60) == 3
        assert not (tmp_path / "d.exit").exists()
    finally:
        build.kill()


def test_session_root_is_shared_by_xdist_workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    assert session_root(tmp_path / "popen-gw1") == tmp_path
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert session_root(tmp_path) == tmp_path
    with pytest.raises(ValueError):
        main([str(tmp_path)])  # OUT_DIR and SESSION_PID are both required
