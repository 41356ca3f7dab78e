"""A Ray cluster of several "nodes" on this host, for tests, benchmarks and trying `--launcher ray`.

`ray start --head` plus one `ray start --address` per extra node, each raylet with its own custom
resource (`node0`, `node1`, ...) so placement can be steered onto a chosen "node". Every port is
picked free at start (Ray's defaults are fixed ports: two clusters on one host would collide),
the dashboard is off, and `close()` stops this cluster's processes only (`ray stop` would stop
every Ray on the host). Ray 2.60 takes the host's address as the nodes' address even when asked
for 127.0.0.1, so the components bind that address, as on a real cluster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from milepost.launch.process import free_port

# One raylet's listening ports, each taken from the OS at start.
_PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
               "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
               "--runtime-env-agent-port", "--dashboard-port")
_OBJECT_STORE_BYTES = 100 * (1 << 20)  # the components pass no objects bigger than a log chunk


class LocalRayCluster:
    """`with LocalRayCluster(nodes=2, cpus_per_node=4) as c: ... c.address ...`."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 4, timeout_s: float = 180.0,
                 gpus_per_node: int = 0) -> None:
        self.nodes, self.gpus_per_node = nodes, gpus_per_node
        # AF_UNIX socket paths are limited to 107 bytes: Ray puts its sockets under the temp
        # dir, so it must be short (pytest's tmp_path is too long).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="mpray-", dir="/tmp"))
        self.address = ""
        self._env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
        try:
            ports = self._start(["--head", "--include-dashboard=false"], ("--port", "--ray-client-server-port"),
                                0, cpus_per_node, timeout_s)
            self.address = f"127.0.0.1:{ports['--port']}"
            for i in range(1, nodes):
                self._start(["--address", self.address], (), i, cpus_per_node, timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, role: list[str], port_flags: tuple[str, ...], index: int, cpus: int,
               timeout_s: float) -> dict[str, int]:
        """`ray start` one raylet; the ports given to `port_flags` and _PORT_FLAGS."""
        low = free_port()  # a small range of worker ports from one the OS just gave out
        workers = range(low, min(65535, low + 200) + 1)
        chosen: dict[str, int] = {}
        for flag in (*port_flags, *_PORT_FLAGS):  # each outside the workers' range: Ray
            port = free_port()                     # refuses an overlap
            while port in workers or port in chosen.values():
                port = free_port()
            chosen[flag] = port
        ports = [x for flag, port in chosen.items() for x in (flag, str(port))]
        cmd = [_ray_cli(), "start", *role, "--node-ip-address", "127.0.0.1", *ports,
               "--min-worker-port", str(workers.start), "--max-worker-port", str(workers.stop - 1),
               "--num-cpus", str(cpus), "--num-gpus", str(self.gpus_per_node), "--resources", f'{{"node{index}": 100}}',
               "--object-store-memory", str(_OBJECT_STORE_BYTES), "--temp-dir", str(self.temp_dir),
               "--disable-usage-stats"]
        done = subprocess.run(cmd, check=False, env=self._env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return chosen

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every process of this cluster (SIGTERM, SIGKILL after grace_s), remove its dir."""
        pids = self.pids()  # taken once: the agents lose their parent (and so our trace) first
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.3)
        for pid in pids:
            if _running(pid):
                _signal(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def pids(self) -> list[int]:
        """Processes of this cluster still running: those whose command line names its temp dir
        (GCS, raylets, workers) and all their descendants (agents rename themselves, and the
        components the actors start), never this process."""
        needle, parent, roots = str(self.temp_dir).encode(), {}, set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            pid = int(entry.name)
            parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
            if needle in cmdline:
                roots.add(pid)
        found = set(roots)
        for pid in parent:
            chain, p = [], pid
            while p in parent and p not in found and p > 1 and len(chain) < 64:
                chain.append(p)
                p = parent[p]
            if p in found:
                found.update(chain)
        found.discard(os.getpid())
        return sorted(p for p in found if _running(p))

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ray_cli() -> str:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else "ray"


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    """`python -m milepost.launch.ray_cluster [--nodes N] [--gpus-per-node G] -- CMD ...`: run CMD
    with RAY_ADDRESS set to a fresh local cluster (`--launcher ray` finds it), then stop it."""
    p = argparse.ArgumentParser(prog="python -m milepost.launch.ray_cluster", description=main.__doc__)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--cpus-per-node", type=int, default=os.cpu_count() or 1)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd  # only the separator: CMD may use -- too
    if not cmd:
        p.error("give the command to run after --")
    with LocalRayCluster(a.nodes, a.cpus_per_node, gpus_per_node=a.gpus_per_node) as cluster:
        return subprocess.run(cmd, check=False, env={**os.environ, "RAY_ADDRESS": cluster.address}).returncode


if __name__ == "__main__":
    sys.exit(main())
