"""Children started by `ManagedProcess` get passive OpenMP waits unless the environment chose."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from milepost.launch.process import OPENMP_DEFAULTS, ManagedProcess, openmp_defaults

PRINT_POLICY = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('OMP_WAIT_POLICY', '<unset>'))"


def _child_policy(tmp_path: Path, env: dict[str, str] | None = None) -> str:
    out = tmp_path / "policy.txt"
    proc = ManagedProcess("child", [sys.executable, "-c", PRINT_POLICY, str(out)], tmp_path / "child.log",
                          health_url=None, env=env)
    assert proc.proc.wait(timeout=120) == 0, proc.log_tail()
    proc.close()
    return out.read_text()


def test_children_wait_passively_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert openmp_defaults() == OPENMP_DEFAULTS == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert _child_policy(tmp_path) == "PASSIVE"


def test_the_users_choice_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert openmp_defaults() == {}
    assert _child_policy(tmp_path) == "ACTIVE"
    assert _child_policy(tmp_path, env={"OMP_WAIT_POLICY": "PASSIVE"}) == "PASSIVE"
