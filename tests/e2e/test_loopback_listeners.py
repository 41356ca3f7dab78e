"""`milepost train` opens no listening socket outside loopback: engines, sglang-router (its API and
its Prometheus endpoint, which would otherwise take 0.0.0.0:29000), the trainer ranks' rendezvous
and gloo sockets, and the trainer-to-engine broadcast group. The run's whole process tree is
sampled while it trains."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from milepost.testing.checkpoints import make_tiny_checkpoint

RUN_TIMEOUT_S = 300  # ~20 s on an idle 2-core machine; generous for a loaded one


def _listeners(root: psutil.Process) -> set[tuple[str, str, int]]:
    """(process kind, address, port) of every TCP listening socket in root's tree."""
    found = set()
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(p.cmdline())
            conns = p.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        # sglang-router renames its process "sglang::router"
        kind = ("router" if "sglang" in cmd else "rank" if "driver.worker" in cmd
                else "engine" if " serve " in cmd else "launcher")
        found |= {(kind, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return found


def test_train_listens_on_loopback_only(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'hf_checkpoint = "{tmp_path / "m"}"\nprompt_data = "{tmp_path / "p.jsonl"}"\n'
        "num_rollout = 2\nrollout_batch_size = 2\nn_samples_per_prompt = 2\n"
        "rollout_max_response_len = 8\nengine_max_total_tokens = 2048\ndevice = \"cpu\"\n"
        "actor_num_gpus_per_node = 2\nrollout_num_engines = 2\nrouter = true\n"
        'update_weight_transfer_mode = "broadcast"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "milepost", "train", str(recipe), "--run-dir", str(tmp_path / "run")],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: set[tuple[str, str, int]] = set()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _listeners(root)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    assert proc.returncode == 0, out[-4000:]
    kinds = {k for k, _, _ in seen}
    assert {"router", "rank", "engine"} <= kinds, (seen, out[-2000:])
    outside = sorted(s for s in seen if not ipaddress.ip_address(s[1]).is_loopback)
    assert not outside, f"listening outside loopback: {outside}"
    router_ports = [port for k, _, port in seen if k == "router"]
    assert 29000 not in router_ports  # the metrics endpoint got a free port, not the fixed one
