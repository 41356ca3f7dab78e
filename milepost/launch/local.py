"""Placement on one host: start engines, the router and the trainer ranks as local processes.

One place decides which process gets which device and port, starts every component, and stops
them all (also when one of them fails). Devices: trainer rank r uses GPU r; an engine uses the
GPU of trainer rank i % ranks when colocated, else the GPUs after the trainer's. A Ray launcher
for many hosts will start the same components (same commands, same arguments) on other nodes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from milepost.launch.process import ManagedProcess, free_port

log = logging.getLogger(__name__)


class LocalLauncher:
    """`with LocalLauncher(cfg, run_dir) as launch: urls = launch.start_engines(); ...`."""

    def __init__(self, cfg: object, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.logs = self.run_dir / "logs"
        self.components: list[ManagedProcess] = []
        self.on_gpu = cfg.device == "cuda"

    # ---- engines and router ------------------------------------------------------------------
    def start_engines(self) -> list[str]:
        cfg = self.cfg
        if cfg.engine_backend == "external":
            for url in cfg.engine_urls:
                _check_health(url)
            return list(cfg.engine_urls)
        urls = []
        for i in range(cfg.rollout_num_engines):
            port = free_port()
            cmd = self._engine_cmd(port)
            proc = ManagedProcess(
                f"engine {i}", cmd, self.logs / f"engine-{i}.log",
                f"http://127.0.0.1:{port}/health", env=self._engine_env(i), timeout_s=600,
            )
            self.components.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
            log.info("engine %d ready at %s", i, urls[-1])
        return urls

    def _engine_cmd(self, port: int) -> list[str]:
        cfg = self.cfg
        common = ["--model-path", str(cfg.hf_checkpoint), "--host", "127.0.0.1", "--port", str(port),
                  "--mem-fraction-static", str(cfg.engine_mem_fraction_static),
                  "--page-size", str(cfg.engine_page_size), "--random-seed", str(cfg.seed)]
        if cfg.engine_max_total_tokens:
            common += ["--max-total-tokens", str(cfg.engine_max_total_tokens)]
        if cfg.engine_backend == "sglang":  # the real SGLang server takes the same flags
            return [sys.executable, "-m", "sglang.launch_server", *common, "--weight-version", "0"]
        return [sys.executable, "-m", "milepost", "serve", *common, "--weight-version", "0",
                "--dtype", cfg.dtype, "--device", cfg.device, "--log-level", "warning"]

    def _engine_env(self, i: int) -> dict[str, str]:
        cfg = self.cfg
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if self.on_gpu:
            n = cfg.rollout_num_gpus_per_engine
            if cfg.colocate:
                first = i % cfg.actor_num_gpus_per_node
            else:
                first = cfg.actor_num_gpus_per_node + i * n
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + k) for k in range(n))
        return env

    def start_router(self, worker_urls: list[str]) -> str:
        """The real sglang-router in front of the engines: manual policy, min_load assignment."""
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--worker-urls", *worker_urls, "--policy", "manual",
               "--assignment-mode", "min_load", "--log-level", "warn"]
        proc = ManagedProcess("router", cmd, self.logs / "router.log",
                              f"http://127.0.0.1:{port}/health", timeout_s=120)
        self.components.append(proc)
        return f"http://127.0.0.1:{port}"

    # ---- trainer ranks -----------------------------------------------------------------------
    def run_trainer_ranks(self, config_path: Path, engine_urls: list[str],
                          router_url: str | None) -> int:
        """Start every trainer rank, wait for all; if one fails, stop the others. Exit code."""
        n = self.cfg.actor_num_gpus_per_node
        port = free_port()
        procs = []
        for rank in range(n):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank)}
            if self.on_gpu:
                env["CUDA_VISIBLE_DEVICES"] = str(rank)
            else:  # split this host's cores among the ranks and the engines
                env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
            cmd = [sys.executable, "-m", "milepost.driver.worker", str(config_path),
                   "--engine-urls", *engine_urls]
            if router_url:
                cmd += ["--router-url", router_url]
            procs.append(subprocess.Popen(cmd, env=env))
        return _wait_all(procs, self.components)

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        for proc in reversed(self.components):
            proc.close()
        self.components.clear()

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_all(procs: list[subprocess.Popen], components: list[ManagedProcess]) -> int:
    """Wait for every rank; the first failure (or a dead engine) stops the rest."""
    reported: set[str] = set()
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                log.error("a trainer rank exited with code %d; stopping the others", failed[0])
                _terminate(procs)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            for c in components:
                if not c.alive and c.name not in reported:
                    reported.add(c.name)
                    log.error("%s stopped (exit code %s); its log: %s", c.name,
                              c.proc.returncode, c.log_path)
            time.sleep(0.5)
    except KeyboardInterrupt:
        _terminate(procs)
        raise


def _terminate(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def _check_health(url: str) -> None:
    try:
        ok = httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError as e:
        raise RuntimeError(f"engine_urls: {url} is not reachable ({e})") from e
    if not ok:
        raise RuntimeError(f"engine_urls: {url}/health did not answer 200")
