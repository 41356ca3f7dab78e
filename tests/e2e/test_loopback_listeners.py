"""One real `milepost train` run (2 engines behind sglang-router, 2 trainer ranks, broadcast
updates with their checksum checks) proves two claims that read the same kind of run:

- it opens no listening socket outside loopback: engines, sglang-router (its API and its
  Prometheus endpoint, which would otherwise take 0.0.0.0:29000), the trainer ranks' rendezvous
  and gloo sockets, and the trainer-to-engine broadcast group; the run's whole process tree is
  sampled while it trains;
- with `api_key` set, rollouts, broadcast weight updates and their checksum checks pass, while
  the run's engines answer 401 to a request without the key.

These were two runs of the same size (tests/e2e/test_api_key.py held the second: ~30 s of CI
time each); one run carries both (docs/testing.md, "Suite time")."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from milepost.testing.checkpoints import make_tiny_checkpoint

RUN_TIMEOUT_S = 300  # ~20 s on an idle 2-core machine; generous for a loaded one
KEY = "e2e-api-key-0123456789"
GEN = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                      "ignore_eos": True}}


def _listeners(tree: list[psutil.Process]) -> set[tuple[str, str, int]]:
    """(process kind, address, port) of every TCP listening socket in the process tree."""
    found = set()
    for p in tree:
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


def _probe_keyless(tree: list[psutil.Process], refused: dict[str, int]) -> None:
    """A request without the key to each engine started with one (launch/local.py passes
    `--api-key=KEY`), once per engine it answers."""
    for p in tree:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "serve" in cmd and "--port" in cmd and any(a.startswith("--api-key=") for a in cmd):
            url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
            if url not in refused:
                try:
                    refused[url] = httpx.post(f"{url}/generate", json=GEN, timeout=10).status_code
                except httpx.HTTPError:
                    pass  # not listening yet


def test_train_listens_on_loopback_only_and_trains_with_an_api_key(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3)
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'hf_checkpoint = "{tmp_path / "m"}"\nprompt_data = "{tmp_path / "p.jsonl"}"\n'
        "num_rollout = 2\nrollout_batch_size = 2\nn_samples_per_prompt = 2\n"
        "rollout_max_response_len = 8\nengine_max_total_tokens = 2048\ndevice = \"cpu\"\n"
        "actor_num_gpus_per_node = 2\nrollout_num_engines = 2\nrouter = true\n"
        f'check_weight_update = true\nupdate_weight_transfer_mode = "broadcast"\napi_key = "{KEY}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "milepost", "train", str(recipe), "--run-dir", str(tmp_path / "run")],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: set[tuple[str, str, int]] = set()
    refused: dict[str, int] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break  # the launcher exited between poll() and here
            seen |= _listeners(tree)
            _probe_keyless(tree, refused)
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
    assert refused and set(refused.values()) == {401}, refused
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
