"""How the launcher reports a trainer rank that ended: killed by a signal (no error of its own to
point at) versus exited with an error code; the other ranks are stopped either way."""

from __future__ import annotations

import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

from milepost.launch.local import LocalLauncher


def _launcher(tmp_path: Path) -> LocalLauncher:
    return LocalLauncher(types.SimpleNamespace(device="cpu"), tmp_path)


@pytest.mark.parametrize("code, says, never", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
     "was killed by SIGKILL and printed no error of its own", "above"),
    ("raise SystemExit(3)", "exited with code 3 (any error it printed is above)", "killed"),
])
def test_a_rank_that_ends_is_named_for_how(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                           code: str, says: str, never: str) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dying = subprocess.Popen([sys.executable, "-c", code])
    with caplog.at_level(logging.ERROR, "milepost.launch.local"):
        rc = _launcher(tmp_path)._wait_all([other, dying])
    assert rc != 0 and other.poll() is not None  # the other rank was stopped
    line = next(r.getMessage() for r in caplog.records if "trainer rank 1" in r.getMessage())
    assert says in line and never not in line, line
