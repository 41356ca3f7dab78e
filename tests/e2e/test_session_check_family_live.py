"""`milepost check-family --serve` end to end: the CLI starts a real engine on the tiny
tool-calling checkpoint and runs both family checks (CPU battery, live turns) through it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.testing.agent_model import make_agent_model


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_agent_model(tmp_path_factory.getbasetemp() / "agent_model_shared")


def test_check_family_live_passes_on_a_checkpoint_of_the_family(agent_dir) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "milepost", "check-family", "--model", str(agent_dir),
         "--family", "qwen3", "--serve", "--max-tokens", "96", "--turns", "3",
         "--prompt", "Weather in Oslo?", "--prompt", "Thanks!"],
        capture_output=True, text=True, timeout=900, env=env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "CPU append-only check:" in out and "live check:" in out
    for line in ("ok   turn 2 extends turn 1", "ok   turn 3 extends turn 2",
                 "ok   turn 1 stop token",
                 "ok   trained ids are the engine's", "ok   tool-call output parses"):
        assert line in out, out
