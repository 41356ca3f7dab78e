"""The tests' forked `milepost serve` (milepost/testing/server_fork.py) behaves as the spawned one:
exit codes, what it writes to its log, signals, process group, and the sys.path a fresh
`python -m` would have. Each claim is checked on both kinds, side by side."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from milepost.testing import server_process
from milepost.testing.server_fork import ForkedServer, _fresh_sys_path, _interpreter_path
from milepost.testing.server_process import ServerProcess

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="servers fork on CPU only")


def _server(model_dir: Path, forked: bool, monkeypatch: pytest.MonkeyPatch) -> ServerProcess:
    monkeypatch.setattr(server_process, "FORK_FROM_PRELOADED", forked)
    srv = ServerProcess(model_dir, "--max-total-tokens", "2048")
    assert isinstance(srv.proc, ForkedServer) == forked
    return srv


def test_a_forked_server_serves_and_stops_on_a_signal_like_a_spawned_one(qwen3_dir, monkeypatch):
    """SIGTERM on both kinds (same exit code); SIGKILL on a forked one reads -9, as Popen's does."""
    codes, groups = {}, []
    for forked, sig in ((True, signal.SIGTERM), (False, signal.SIGTERM), (True, signal.SIGKILL)):
        srv = _server(qwen3_dir, forked, monkeypatch)
        try:
            r = httpx.post(f"{srv.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
                "max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True}}, timeout=60)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
            groups.append((os.getpgid(srv.proc.pid), os.getsid(srv.proc.pid)))
            srv.proc.send_signal(sig)
            codes[forked, sig] = srv.proc.wait(timeout=60)
        finally:
            srv.close()
    assert codes[True, signal.SIGTERM] == codes[False, signal.SIGTERM], codes
    assert codes[True, signal.SIGKILL] == -signal.SIGKILL, codes
    # All in the test process's group and session: killing the group stops them alike.
    assert groups == [(os.getpgid(0), os.getsid(0))] * 3


def test_a_failed_start_exits_with_the_same_code_and_message_in_its_log(tmp_path, monkeypatch):
    missing = tmp_path / "no-model"
    missing.mkdir()
    logs = []
    for forked in (True, False):
        monkeypatch.setattr(server_process, "FORK_FROM_PRELOADED", forked)
        with pytest.raises(RuntimeError, match="exited with code") as e:
            ServerProcess(missing, timeout_s=120)
        code = str(e.value).split("exited with code ")[1].split(";")[0]
        log = str(e.value).rsplit(":\n", 1)[1]
        logs.append((code, log.strip().splitlines()[-1:]))
        for f in missing.glob("server-*.log"):
            f.unlink()
    assert logs[0] == logs[1] and logs[0][1], logs


def test_the_child_gets_the_sys_path_of_a_fresh_python_m(tmp_path):
    (tmp_path / "probe_path.py").write_text("import sys; print(repr(sys.path))\n")
    extra = tmp_path / "plugins"
    extra.mkdir()
    env = {**os.environ, "PYTHONPATH": str(extra)}
    fresh = subprocess.run([sys.executable, "-m", "probe_path"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert eval(fresh) == _fresh_sys_path(env, str(tmp_path), _interpreter_path())  # noqa: S307
