"""Placement on one host: start engines, the router and the trainer ranks as local processes.

One place decides which process gets which device and port, starts every component, and stops
them all: when one of them fails, and also when the launcher itself is killed (every child is
tied to it, see `die_with_parent`). An engine or router that dies mid-run stops the run with a
message naming it, rather than leaving the trainer to retry a dead server. Devices: trainer rank
r uses GPU r; an engine uses the GPU of trainer rank i % ranks when colocated, else the GPUs
after the trainer's. A Ray launcher for many hosts will start the same components (same
commands, same arguments) on other nodes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from milepost.launch.external import check_external_engines, check_router
from milepost.launch.process import (
    ManagedProcess,
    die_with_parent,
    free_port,
    openmp_defaults,
)
from milepost.launch.rendezvous import LOOPBACK_SOCKET_ENV
from milepost.lora.rules import adapts_experts
from milepost.lowprec.rules import engine_precision_flags

log = logging.getLogger(__name__)


class LocalLauncher:
    """`with LocalLauncher(cfg, run_dir) as launch: urls = launch.start_engines(); ...`."""

    def __init__(self, cfg: object, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.logs = self.run_dir / "logs"
        self.components: list[ManagedProcess] = []
        self.urls: dict[str, str] = {}  # component name -> its base URL, for messages
        self.on_gpu = cfg.device == "cuda"

    # ---- engines and router ------------------------------------------------------------------
    def start_engines(self, wait: bool = True) -> list[str]:
        """Start the engines; their URLs. wait=False returns before they are healthy: the
        caller starts the trainer ranks meanwhile (both load weights: minutes on big models),
        `run_trainer_ranks` watches the engines finish starting, and rank 0 waits for them
        before its first request."""
        cfg = self.cfg
        if cfg.engine_backend == "external":  # the user's servers: checked, not started
            check_external_engines(list(cfg.engine_urls), cfg.hf_checkpoint, cfg.api_key)
            return list(cfg.engine_urls)
        urls = []
        for i in range(cfg.rollout_num_engines):
            port = free_port()
            cmd = self._engine_cmd(port)
            proc = ManagedProcess(
                f"engine {i}", cmd, self.logs / f"engine-{i}.log",
                f"http://127.0.0.1:{port}/health", env=self._engine_env(i), timeout_s=600,
                tied_to_parent=True, wait=wait,
            )
            self.components.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
            self.urls[proc.name] = urls[-1]
            log.info("engine %d %s at %s", i, "ready" if wait else "starting", urls[-1])
        return urls

    def _engine_cmd(self, port: int) -> list[str]:
        cfg = self.cfg
        common = ["--model-path", str(cfg.hf_checkpoint), "--host", "127.0.0.1", "--port", str(port),
                  "--mem-fraction-static", str(cfg.engine_mem_fraction_static),
                  "--page-size", str(cfg.engine_page_size), "--random-seed", str(cfg.seed)]
        if cfg.engine_max_total_tokens:
            common += ["--max-total-tokens", str(cfg.engine_max_total_tokens)]
        for flag, value in (("--speculative-algorithm", cfg.engine_speculative_algorithm),
                            ("--speculative-num-steps", cfg.engine_speculative_num_steps),
                            ("--speculative-eagle-topk", cfg.engine_speculative_eagle_topk),
                            ("--speculative-num-draft-tokens", cfg.engine_speculative_num_draft_tokens),
                            ("--speculative-ngram-scope", cfg.engine_speculative_ngram_scope)):
            if value is not None:  # SGLang's own flags: the embedded engine and sglang read them alike
                common += [flag, str(value)]
        if cfg.engine_quantization:  # fp8 weight storage (milepost/engine/weight_fp8.py)
            common += ["--quantization", cfg.engine_quantization]
        common += engine_precision_flags(cfg)  # --precision's engine side (milepost/lowprec/)
        if cfg.lora_rank:  # the engines serve the trained adapter beside the base (docs/lora.md)
            common += ["--enable-lora", "--max-lora-rank", str(cfg.lora_rank),
                       "--lora-target-modules", cfg.lora_target_modules]
            if cfg.adapters and len(cfg.adapters) > 8:  # multi-LoRA: a slot for each (8 by default)
                common += ["--max-loras-per-batch", str(len(cfg.adapters))]
            elif not cfg.adapters and adapts_experts(cfg.hf_checkpoint, cfg.lora_target_modules):
                common += ["--max-loras-per-batch", "1"]  # expert deltas are merged: one adapter
        if cfg.true_on_policy:  # re-score finished sequences with the trainer's computation
            common += ["--true-on-policy"]
        if cfg.api_key:  # the same flag on SGLang's server and ours (milepost/auth.py)
            common += [f"--api-key={cfg.api_key}"]  # "=": a key may start with "-"
        if cfg.engine_backend == "sglang":  # the real SGLang server takes the same flags
            return [sys.executable, "-m", "sglang.launch_server", *common, "--weight-version", "0"]
        return [sys.executable, "-m", "milepost", "serve", *common, "--weight-version", "0",
                "--dtype", cfg.dtype, "--device", cfg.device, "--log-level", "warning"]

    def _engine_env(self, i: int) -> dict[str, str]:
        cfg = self.cfg
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **_loopback_sockets()}
        if cfg.true_on_policy and not self.on_gpu:  # the re-score's reductions split like the trainer's
            env["OMP_NUM_THREADS"] = str(cfg.trainer_cpu_threads or 1)
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
        # Its Prometheus endpoint defaults to 0.0.0.0:29000: all interfaces, and a fixed port that
        # two runs on one host would both want.
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--worker-urls", *worker_urls, "--policy", "manual",
               "--assignment-mode", "min_load", "--log-level", "warn",
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if self.cfg.api_key:  # the router sends it to the engines
            cmd += [f"--api-key={self.cfg.api_key}"]  # "=": a key may start with "-"
        proc = ManagedProcess("router", cmd, self.logs / "router.log",
                              f"http://127.0.0.1:{port}/health", timeout_s=120, tied_to_parent=True)
        self.components.append(proc)
        self.urls[proc.name] = f"http://127.0.0.1:{port}"
        if self.cfg.engine_backend == "external":  # servers milepost did not start, via the router
            check_router(self.urls[proc.name], self.cfg.api_key)
        return self.urls[proc.name]

    # ---- trainer ranks -----------------------------------------------------------------------
    def run_trainer_ranks(self, config_path: Path, engine_urls: list[str],
                          router_url: str | None) -> int:
        """Start every trainer rank, wait for all; if one fails, stop the others. Exit code."""
        n = self.cfg.actor_num_gpus_per_node
        port = free_port()
        procs = []
        for rank in range(n):
            env = {**os.environ, **openmp_defaults(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank),
                   **_loopback_sockets()}
            if self.on_gpu:
                env["CUDA_VISIBLE_DEVICES"] = str(rank)
            else:  # split this host's cores among the ranks and the engines
                env["OMP_NUM_THREADS"] = str(self._trainer_threads(n))
            cmd = [sys.executable, "-m", "milepost.driver.worker", str(config_path),
                   "--engine-urls", *engine_urls]
            if router_url:
                cmd += ["--router-url", router_url]
            # preexec_fn runs prctl only (no Python objects, no locks): safe despite the warning.
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent()))  # noqa: PLW1509
        with _sigterm_as_exit():
            return self._wait_all(procs)

    def _trainer_threads(self, ranks: int) -> int:
        """CPU threads per trainer rank. Under --fully-async the engines generate while the
        ranks train, so the engines' threads are taken out first: oversubscribed cores stall
        every OpenMP barrier of the trainer (seen on a busy 2-core VM: a train step of 8 samples
        took ~2 s with 2 threads, 25-70 ms with 1)."""
        if self.cfg.trainer_cpu_threads is not None:
            return self.cfg.trainer_cpu_threads
        cores = os.cpu_count() or 1
        if self.cfg.fully_async and self.cfg.engine_backend != "external":
            engine_threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
            cores -= engine_threads * int(self.cfg.rollout_num_engines or 1)
        return max(1, cores // ranks)

    def _wait_all(self, procs: list[subprocess.Popen]) -> int:
        """Wait for every rank. The first rank to fail, or an engine / the router dying, stops
        the others: a dead engine cannot come back (weight updates and rollouts would only
        fail against it, or hang), so the run ends there with a message naming it."""
        try:
            while True:
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    return 0
                for c in self.components:  # started with wait=False: still coming up?
                    if not c.ready and c.poll_ready():
                        log.info("%s ready at %s", c.name, self.urls.get(c.name, "?"))
                dead = self._dead_components()
                if dead:
                    log.error("%s; stopping the trainer ranks", dead)
                    _terminate(procs)
                    return 1
                failed = [c for c in codes if c not in (None, 0)]
                if failed:
                    dead = self._dead_components()  # often the cause: say so
                    log.error("trainer rank %d %s; stopping the others%s", codes.index(failed[0]),
                              _how_it_ended(failed[0]), f" ({dead})" if dead else "")
                    _terminate(procs)
                    return failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by a signal
                _wait_one(procs, 0.5)
        except BaseException as e:  # a failed start, Ctrl-C, SIGTERM: never leave ranks behind
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                log.warning("interrupted (%s); stopping the trainer ranks and engines",
                            "Ctrl-C" if isinstance(e, KeyboardInterrupt) else "SIGTERM")
            _terminate(procs)
            raise

    def _dead_components(self) -> str:
        """'' while every engine and the router run, else what stopped and where its log is."""
        lines = []
        for c in self.components:
            if not c.alive:
                tail = c.log_tail(800).strip()
                lines.append(f"{c.name} ({self.urls.get(c.name, '?')}) stopped with exit code "
                             f"{c.proc.returncode} while the run was going; its log: {c.log_path}"
                             + (f"; last lines:\n{tail}" if tail else ""))
        return "\n".join(lines)

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        for proc in reversed(self.components):
            proc.close()
        self.components.clear()

    def __enter__(self) -> LocalLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _sigterm_as_exit:
    """While waiting on the ranks, SIGTERM raises SystemExit (like Ctrl-C raises
    KeyboardInterrupt), so `kill <launcher>` still stops the ranks and closes the engines."""

    def __enter__(self) -> None:
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


class noted_ctrl_c:
    """While waiting on the ranks, Ctrl-C raises KeyboardInterrupt as usual and is also noted
    (`seen`): a library call it lands in (Ray's `get`) may turn it into an error of its own, and
    the run must still say that it stopped because of Ctrl-C."""

    def __enter__(self) -> "noted_ctrl_c":
        self.seen, self._old = False, None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._raise)
        return self

    def _raise(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def _terminate(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def _wait_one(procs: list[subprocess.Popen], seconds: float) -> None:
    """Sleep up to `seconds`, waking as soon as the first running rank ends (the run's end is
    then seen at once, not up to half a second later: every `milepost train` pays that)."""
    running = [p for p in procs if p.poll() is None]
    if not running:
        return
    try:
        running[0].wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def _how_it_ended(code: int) -> str:
    """A rank's end in words. Killed by a signal it printed nothing, so never point 'above'."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory? see the kernel log: dmesg)" if -code == signal.SIGKILL else ""
        return f"was killed by {name} and printed no error of its own{hint}"
    return f"exited with code {code} (any error it printed is above)"


def _loopback_sockets() -> dict[str, str]:
    """gloo / NCCL socket interfaces for processes of one host: loopback, unless the user chose."""
    return {k: v for k, v in LOOPBACK_SOCKET_ENV.items() if k not in os.environ}
