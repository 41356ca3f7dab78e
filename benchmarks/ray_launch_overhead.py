"""Launch overhead of `--launcher ray` against the local launcher, on CPU: time to the first rollout.

`python benchmarks/ray_launch_overhead.py DEMO_DIR [--repeats 2]` (DEMO_DIR from
`python -m milepost.demo.prepare DEMO_DIR`). Each repeat runs the tiny demo for one rollout with 2
trainer ranks and one engine (broadcast), first with the local launcher, then on a fresh local
Ray cluster of two "nodes" (engine on one, ranks on the other; milepost/launch/ray_cluster.py).
Time to first rollout = from the start (of `ray start` for Ray, of `milepost train` for both)
to the end of the first rollout (its metrics record: time - step_time + rollout_time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from milepost.launch.ray_cluster import LocalRayCluster

ROOT = Path(__file__).resolve().parents[1]


def _train(demo: Path, run_dir: Path, *extra: str) -> float:
    """Run one rollout; the wall-clock time (epoch s) its first rollout ended."""
    cmd = [sys.executable, "-m", "milepost", "train", str(ROOT / "recipes" / "tiny_demo.toml"),
           "--hf-checkpoint", str(demo / "base_model"), "--prompt-data", str(demo / "rl_prompts.jsonl"),
           "--eval-interval", "0", "--eval-prompt-data", "none", "--run-dir", str(run_dir),
           "--num-rollout", "1", "--save-hf-at-end", "false", "--actor-num-gpus-per-node", "2",
           "--update-weight-transfer-mode", "broadcast", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1200)
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    return rec["time"] - rec["perf/step_time"] + rec["perf/rollout_time"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dir", type=Path)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    local, ray_total, ray_cluster, ray_train = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            t0 = time.time()
            local.append(_train(args.demo_dir, Path(tmp) / f"local-{i}") - t0)
            t0 = time.time()
            with LocalRayCluster(nodes=2, cpus_per_node=4) as cluster:
                t1 = time.time()
                end = _train(args.demo_dir, Path(tmp) / f"ray-{i}", "--launcher", "ray",
                             "--ray-address", cluster.address, "--ray-engine-resources", "node0",
                             "--ray-trainer-resources", "node1")
            ray_total.append(end - t0)
            ray_cluster.append(t1 - t0)
            ray_train.append(end - t1)
            print(f"repeat {i}: local {local[-1]:.1f} s; ray {ray_total[-1]:.1f} s "
                  f"(cluster up {ray_cluster[-1]:.1f} s + train to first rollout {ray_train[-1]:.1f} s); "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)
    med = statistics.median
    print(f"{platform.node()} {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}: time to first rollout, "
          f"median of {args.repeats}: local {med(local):.1f} s, ray {med(ray_total):.1f} s "
          f"(cluster up {med(ray_cluster):.1f} s, launcher to first rollout {med(ray_train):.1f} s)")


if __name__ == "__main__":
    main()
