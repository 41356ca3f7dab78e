"""`milepost train --launcher ray` on a real Ray cluster of two "nodes" on this host.

A head and a second raylet (milepost/launch/ray_cluster.py), each with its own custom resource,
so `--ray-engine-resources node0 --ray-trainer-resources node1` puts the engine on one node and
the 2 trainer ranks on the other. The default tests are short (placement, wiring over the
nodes' address with the run's key, a killed engine named, Ctrl-C and a killed driver leaving no
actor or process, a too-big run refused); the learning runs (20 rollouts each, broadcast and p2p)
and resume on a new cluster plus a colocated run (minutes on 2 cores) are opt-in.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")

from milepost.launch.ray_cluster import LocalRayCluster

# One worker runs this module, so one Ray cluster (the module fixture) serves all its tests: two
# clusters at once, one per xdist worker, pushed both training tests past their limits when loaded
pytestmark = pytest.mark.xdist_group("ray_cluster")

ROOT = Path(__file__).resolve().parents[2]
_STARTED = re.compile(r"(engine \d+|trainer rank \d+) started on node (\S+) \(ray node (\w+)\)(?: at (\S+))?")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    with LocalRayCluster(nodes=2, cpus_per_node=4) as c:
        yield c


def _train_cmd(cluster: LocalRayCluster, demo_dir: Path, run_dir: Path, num_rollout: int,
               transport: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "milepost", "train", str(ROOT / "recipes" / "tiny_demo.toml"),
            "--hf-checkpoint", str(demo_dir / "base_model"), "--prompt-data",
            str(demo_dir / "rl_prompts.jsonl"), "--eval-interval", "0", "--eval-prompt-data", "none",
            "--run-dir", str(run_dir), "--num-rollout", str(num_rollout), "--save-hf-at-end", "false",
            "--launcher", "ray", "--ray-address", cluster.address, "--actor-num-gpus-per-node", "2",
            "--ray-engine-resources", "node0", "--ray-trainer-resources", "node1",
            "--update-weight-transfer-mode", transport, *extra]


def _cluster_view(cluster: LocalRayCluster) -> dict:
    """{"nodes": {node id: [its nodeN resources], ...}, "ips": [...], "actors": [named actors]},
    asked from a separate driver so this process never joins the cluster."""
    code = (
        "import json, logging, ray\n"
        f"ray.init(address={cluster.address!r}, logging_level=logging.ERROR, log_to_driver=False)\n"
        "nodes = [n for n in ray.nodes() if n['Alive']]\n"
        "print(json.dumps({'nodes': {n['NodeID']: sorted(k for k in n['Resources'] if "
        "k.startswith('node') and ':' not in k) for n in nodes},\n"
        "  'ips': sorted({n['NodeManagerAddress'] for n in nodes}),\n"
        "  'actors': ray.util.list_named_actors(all_namespaces=True)}))\n"
        "ray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _leftovers(cluster: LocalRayCluster) -> tuple[list[str], list[str]]:
    """(named actors: the launcher names all of its own, milepost processes in the cluster)."""
    processes = [c.replace(b"\0", b" ").decode() for c in map(_cmdline, cluster.pids())
                 if b"milepost" in c]
    return _cluster_view(cluster)["actors"], processes


def _assert_no_leftovers(cluster: LocalRayCluster) -> None:
    assert _leftovers(cluster) == ([], [])


def _start_then(cluster: LocalRayCluster, cmd: list[str], out_path: Path,
                timeout_s: float) -> subprocess.Popen:
    """Start `milepost train`; return once every component was started."""
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while "trainer rank 1 started" not in out_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run did not start its ranks: {out_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def test_ray_places_engine_and_ranks_on_their_nodes_and_trains(
    cluster: LocalRayCluster, demo_dir: Path, tmp_path: Path,
    demo_train_timeout_s: Callable[[int], float],
) -> None:
    run_dir = tmp_path / "ray-p2p"
    done = subprocess.run(_train_cmd(cluster, demo_dir, run_dir, 2, "p2p"), capture_output=True,
                          text=True, timeout=demo_train_timeout_s(2), check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["perf/update_weights_bytes"] > 0 for r in records)  # p2p reached the engine

    view = _cluster_view(cluster)
    started = {m[0]: m for m in _STARTED.findall(out)}
    assert sorted(started) == ["engine 0", "trainer rank 0", "trainer rank 1"], out[-3000:]
    assert view["nodes"][started["engine 0"][2]] == ["node0"]
    for rank in ("trainer rank 0", "trainer rank 1"):
        assert view["nodes"][started[rank][2]] == ["node1"]
    # Servers bind the node's address (not loopback), under the run's own key.
    engine_ip, engine_url = started["engine 0"][1], started["engine 0"][3]
    assert engine_ip in view["ips"] and engine_url.startswith(f"http://{engine_ip}:")
    resolved = (run_dir / "config.resolved.toml").read_text()
    assert re.search(r'^api_key = "[\w-]{32,}"$', resolved, re.MULTILINE)
    assert (run_dir / "config.resolved.toml").stat().st_mode & 0o077 == 0
    # Every component's log reached the driver's run directory.
    assert "step 2/2" in (run_dir / "logs" / "trainer-rank-0.log").read_text()
    _assert_no_leftovers(cluster)


def test_a_killed_engine_stops_the_run_naming_it(
    cluster: LocalRayCluster, demo_dir: Path, tmp_path: Path,
    demo_train_timeout_s: Callable[[int], float],
) -> None:
    run_dir, out_path = tmp_path / "ray-kill", tmp_path / "train.out"
    # 1000 rollouts, as in the stopped-driver test below: the engine must still run when the kill
    # comes, and listing the cluster's processes took minutes on a loaded machine (20 rollouts
    # take ~40 s idle); the kill ends the run long before.
    proc = _start_then(cluster, _train_cmd(cluster, demo_dir, run_dir, 1000, "broadcast"),
                       out_path, demo_train_timeout_s(1))
    try:
        # The engine listens on its node's address and answers nothing but /health without the
        # run's key.
        url = _STARTED.search(out_path.read_text()).group(4)
        key = re.search(r'^api_key = "(.+)"$', (run_dir / "config.resolved.toml").read_text(),
                        re.MULTILINE).group(1)
        deadline = time.monotonic() + demo_train_timeout_s(1)
        while not _answers(f"{url}/health"):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.5)
        assert httpx.get(f"{url}/get_weight_version", timeout=30).status_code == 401
        authorized = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/get_weight_version", headers=authorized, timeout=30).status_code == 200
        engine = [p for p in cluster.pids() if b"milepost\0serve" in _cmdline(p)
                  and str(demo_dir).encode() in _cmdline(p)]
        assert len(engine) == 1
        os.kill(engine[0], signal.SIGKILL)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out_path.read_text()
    assert rc != 0, text[-3000:]
    assert re.search(r"engine 0 \(http://\S+, node \S+\) stopped with exit code -9", text), text[-3000:]
    _assert_no_leftovers(cluster)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_a_stopped_driver_leaves_no_actor_or_process(
    cluster: LocalRayCluster, demo_dir: Path, tmp_path: Path, sig: signal.Signals,
    demo_train_timeout_s: Callable[[int], float],
) -> None:
    """Ctrl-C: the launcher stops everything before it exits. SIGKILL: no code of the driver
    runs; Ray removes the actors the dead driver owned, and each component dies with its actor."""
    # 1000 rollouts: the run must still be going when the signal comes (20 once ended first
    # while a loaded machine spent two minutes listing the cluster's processes).
    proc = _start_then(cluster, _train_cmd(cluster, demo_dir, tmp_path / "run", 1000, "broadcast"),
                       tmp_path / "train.out", demo_train_timeout_s(1))
    try:
        assert _leftovers(cluster)[1], "the run's components should be up"
        assert proc.poll() is None, "the run ended before the signal"
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0
    if sig == signal.SIGINT:
        text = (tmp_path / "train.out").read_text()
        assert "interrupted (Ctrl-C)" in text, text[-3000:]
        _assert_no_leftovers(cluster)  # at once: the driver cleaned up before exiting
        return
    deadline = time.monotonic() + 120
    while (left := _leftovers(cluster)) != ([], []):
        assert time.monotonic() < deadline, left
        time.sleep(2)


def test_a_run_the_cluster_cannot_hold_is_refused_with_the_numbers(
    cluster: LocalRayCluster, demo_dir: Path, tmp_path: Path,
) -> None:
    cmd = _train_cmd(cluster, demo_dir, tmp_path / "too-big", 1, "broadcast")
    cmd[cmd.index("--actor-num-gpus-per-node") + 1] = "8"  # 8 ranks + 1 engine: 9 CPUs of 8
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1
    assert "lacks CPU: the run asks 9 (trainer: 8 x 1, engines: 1 x 1), the cluster has 8" in done.stderr, \
        done.stderr[-2000:]
    _assert_no_leftovers(cluster)


def test_an_unreachable_head_is_refused_at_start(demo_dir: Path, tmp_path: Path) -> None:
    """(Not `--ray-address auto` with no cluster: Ray's auto finds any GCS process on the host,
    such as this module's cluster.)"""
    cmd = [sys.executable, "-m", "milepost", "train", str(ROOT / "recipes" / "tiny_demo.toml"),
           "--hf-checkpoint", str(demo_dir / "base_model"), "--prompt-data",
           str(demo_dir / "rl_prompts.jsonl"), "--eval-interval", "0", "--eval-prompt-data", "none",
           "--run-dir", str(tmp_path / "run"), "--launcher", "ray", "--ray-address", "127.0.0.1:1"]
    says = "--ray-address 127.0.0.1:1: the Ray head is unreachable"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, env=env)
    assert done.returncode == 1 and says in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.optin
@pytest.mark.parametrize("transport", ["broadcast", "p2p"])
def test_the_demo_learns_under_ray_as_under_the_local_launcher(
    cluster: LocalRayCluster, demo_dir: Path, tmp_path: Path, transport: str,
    demo_train_timeout_s: Callable[[int], float],
) -> None:
    """The bound of tests/e2e/test_demo_rl.py (last five rollouts' mean reward >= 0.85)."""
    run_dir = tmp_path / f"ray-{transport}"
    done = subprocess.run(_train_cmd(cluster, demo_dir, run_dir, 20, transport),
                          timeout=demo_train_timeout_s(20), check=False)
    assert done.returncode == 0
    rewards = [json.loads(line)["rollout/reward_mean"]
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rewards) == 20 and rewards[0] <= 0.5, rewards
    assert sum(rewards[-5:]) / 5 >= 0.85, rewards
    _assert_no_leftovers(cluster)


@pytest.mark.optin
def test_resume_auto_continues_on_a_new_cluster_and_colocated_runs(
    cluster: LocalRayCluster, demo_dir: Path, tmp_path: Path,
    demo_train_timeout_s: Callable[[int], float],
) -> None:
    """2 rollouts saved at every step on this cluster; `--resume auto` on a fresh cluster
    continues at step 2. Then a colocated run (rank r and engine r share bundle r)."""
    run_dir = tmp_path / "resumed"
    first = _train_cmd(cluster, demo_dir, run_dir, 2, "broadcast", "--save-interval", "1")
    assert subprocess.run(first, timeout=demo_train_timeout_s(2), check=False).returncode == 0
    with LocalRayCluster(nodes=2, cpus_per_node=4) as fresh:
        again = _train_cmd(fresh, demo_dir, run_dir, 3, "broadcast", "--save-interval", "1",
                           "--resume", "auto")
        done = subprocess.run(again, capture_output=True, text=True,
                              timeout=demo_train_timeout_s(1), check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "continuing at step 2" in done.stdout + done.stderr  # rank output: stdout
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == [0, 1, 2]
        _assert_no_leftovers(fresh)
    coloc = _train_cmd(cluster, demo_dir, tmp_path / "coloc", 1, "tensor", "--colocate")
    for flag in ("--ray-engine-resources", "--ray-trainer-resources"):  # one bundle: either node
        i = coloc.index(flag)
        del coloc[i:i + 2]
    assert subprocess.run(coloc, timeout=demo_train_timeout_s(1), check=False).returncode == 0
    _assert_no_leftovers(cluster)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
