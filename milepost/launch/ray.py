"""Placement on a Ray cluster: the local launcher's components, started as Ray actors on its nodes.

Same interface and same commands as `LocalLauncher` (start_engines, start_router,
run_trainer_ranks, close); what changes is where they run. Each engine and trainer rank is a
`ComponentHost` actor in a placement-group bundle (ray_placement.py says which), and runs its
command as a child process bound to its node's address, not loopback. Trainer rank 0's address
and a free port on its node are the process group's rendezvous; engine URLs carry their node's
address. Servers get the run's API key (sync.run makes one per run when none is set). Logs are
pulled into run_dir/logs; a component whose process or actor dies stops the run, naming it.
Actors and placement groups belong to this driver: Ray removes them if the driver dies.
"""

from __future__ import annotations

import logging
import secrets
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost.launch import ray_placement
from milepost.launch.local import LocalLauncher, _how_it_ended, _sigterm_as_exit, noted_ctrl_c
from milepost.launch.process import ComponentStartError
from milepost.launch.ray_actor import ComponentHost
from milepost.launch.rendezvous import NODE_ADDRESS_ENV

log = logging.getLogger(__name__)

_RPC_TIMEOUT_S = 120.0  # one call to an actor (a busy node answers late, a dead one raises)


class RayLaunchError(ComponentStartError):
    """The cluster cannot take the run (unreachable, too small, an old Ray) or a component failed
    to start on it; the message has the numbers."""


@dataclass
class _Hosted:
    """A component on the cluster, as the driver tracks it."""

    name: str
    actor: Any
    node_ip: str
    node_id: str
    log_path: Path
    url: str | None = None
    echo: bool = False  # copy its output to the driver's stdout (trainer ranks, as locally)
    offset: int = 0
    code: int | None = None
    ready: bool = False
    lost: str = ""  # why its actor is gone, once it is
    started_at: float = 0.0


class RayLauncher(LocalLauncher):
    """`with RayLauncher(cfg, run_dir) as launch: ...`, as LocalLauncher (whose commands it reuses)."""

    def __init__(self, cfg: object, run_dir: Path) -> None:
        super().__init__(cfg, run_dir)
        self.ray = _import_ray()
        self.hosted: list[_Hosted] = []
        self.tag = f"milepost-{self.run_dir.name}-{uuid.uuid4().hex[:6]}"
        self._groups: list[Any] = []
        try:
            self._connect()
            self._place()
        except BaseException:  # a refusal: leave the cluster as it was
            self.close()
            raise

    # ---- cluster -----------------------------------------------------------------------------
    def _connect(self) -> None:
        address = self.cfg.ray_address
        if address != "auto":
            _check_reachable(address)
        try:
            self.ray.init(address=address, namespace="milepost", log_to_driver=False,
                          logging_level=logging.WARNING, configure_logging=False)
        except ConnectionError as e:
            raise RayLaunchError(f"--ray-address {address}: no Ray cluster to join ({e}); start one "
                                 "with `ray start --head` (docs/scaling.md) or pass its HOST:PORT") from e
        total, free = self.ray.cluster_resources(), self.ray.available_resources()
        try:
            problems = ray_placement.refusals(self.cfg, self.on_gpu, total, free)
        except ValueError as e:  # a malformed --ray-*-resources entry
            raise RayLaunchError(str(e)) from None
        if problems:
            raise RayLaunchError("--launcher ray: " + "\n".join(problems))

    def _place(self) -> None:
        """Reserve every bundle now, so a cluster that cannot hold the run fails before anything
        starts (Ray would otherwise wait for resources forever)."""
        from ray.util import placement_group

        trainer, engines = ray_placement.pools(self.cfg, self.on_gpu)
        self.trainer_pool, self.engine_pool = trainer, engines
        for pool in (trainer, engines):
            if pool is None:
                self._groups.append(None)
                continue
            pg = placement_group(pool.bundles, strategy=pool.strategy, name=f"{self.tag}-{pool.name}")
            self._groups.append(pg)
            try:
                self.ray.get(pg.ready(), timeout=self.cfg.ray_placement_timeout_s)
            except self.ray.exceptions.GetTimeoutError:
                raise RayLaunchError(
                    f"--launcher ray: the {pool.name} placement group ({len(pool.bundles)} bundles of "
                    f"{pool.bundles[0]}, {pool.strategy}) could not be placed within "
                    f"{self.cfg.ray_placement_timeout_s:g} s (--ray-placement-timeout-s); the "
                    f"nodes have: {_node_resources(self.ray)}") from None

    def _host(self, name: str, pool_index: int | None, bundle: int, share: float = 1.0,
              echo: bool = False) -> _Hosted:
        """A ComponentHost actor for `name` in bundle `bundle` of group `pool_index` (None: on
        the driver's node, outside the groups: the router)."""
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        if pool_index is None:
            strategy = NodeAffinitySchedulingStrategy(self.ray.get_runtime_context().get_node_id(), soft=True)
            cpus, gpus = 0.0, 0.0
        else:
            pool = (self.trainer_pool, self.engine_pool)[pool_index]
            spec = pool.bundles[bundle]
            strategy = PlacementGroupSchedulingStrategy(self._groups[pool_index],
                                                        placement_group_bundle_index=bundle)
            cpus, gpus = spec.get("CPU", 0.0) * share, spec.get("GPU", 0.0) * share
        actor = self.ray.remote(ComponentHost).options(
            name=f"{self.tag}/{name.replace(' ', '-')}", num_cpus=cpus, num_gpus=gpus,
            max_restarts=0, scheduling_strategy=strategy).remote(name)
        ip, node_id = self._call(actor, "node", what=name)
        h = _Hosted(name, actor, ip, node_id, self.logs / f"{name.replace(' ', '-')}.log", echo=echo)
        self.hosted.append(h)
        unseen = self._call(actor, "check_paths", [str(self.run_dir), str(self.cfg.hf_checkpoint)], what=name)
        if unseen:
            raise RayLaunchError(f"{name} runs on node {ip} ({node_id[:12]}), which cannot see {unseen}: "
                                 "put --run-dir and --hf-checkpoint on a filesystem every node mounts")
        return h

    def _call(self, actor: Any, method: str, *args: Any, what: str) -> Any:
        try:
            return self.ray.get(getattr(actor, method).remote(*args), timeout=_RPC_TIMEOUT_S)
        except self.ray.exceptions.RayActorError as e:
            raise RayLaunchError(f"{what}'s Ray actor died: {str(e).splitlines()[0][:300]}") from e

    def _start(self, h: _Hosted, cmd: list[str], env: dict[str, str], port: int | None) -> None:
        h.url = f"http://{_url_host(h.node_ip)}:{port}" if port else None
        self._call(h.actor, "start", cmd, env, f"{h.url}/health" if h.url else None, what=h.name)
        h.started_at = time.monotonic()
        if h.url:
            self.urls[h.name] = h.url
        log.info("%s started on node %s (ray node %s)%s", h.name, h.node_ip, h.node_id,
                 f" at {h.url}" if h.url else "")

    # ---- engines and router ------------------------------------------------------------------
    def start_engines(self, wait: bool = True) -> list[str]:
        cfg = self.cfg
        if cfg.engine_backend == "external":
            return super().start_engines(wait)
        pool, share = (0, ray_placement.COLOCATED_SHARE) if cfg.colocate else (1, 1.0)
        threads = str(max(1, int(cfg.ray_cpus_per_component * share)))
        engines = []
        for i in range(cfg.rollout_num_engines or 1):
            h = self._host(f"engine {i}", pool, i, share)
            port = self._call(h.actor, "free_port", h.node_ip, what=h.name)
            cmd = _with_host(self._engine_cmd(port), h.node_ip)
            self._start(h, cmd, {"OMP_NUM_THREADS": threads}, port)
            engines.append(h)
        if wait:
            self._wait_ready(engines, timeout_s=600)
        return [h.url for h in engines]

    def start_router(self, worker_urls: list[str]) -> str:
        h = self._host("router", None, 0)
        port = self._call(h.actor, "free_port", h.node_ip, what=h.name)
        metrics_port = self._call(h.actor, "free_port", h.node_ip, what=h.name)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", h.node_ip,
               "--port", str(port), "--worker-urls", *worker_urls, "--policy", "manual",
               "--assignment-mode", "min_load", "--log-level", "warn",
               "--prometheus-host", h.node_ip, "--prometheus-port", str(metrics_port)]
        if self.cfg.api_key:
            cmd += [f"--api-key={self.cfg.api_key}"]  # "=": a key may start with "-"
        self._start(h, cmd, {}, port)
        self._wait_ready([h], timeout_s=120)
        return h.url

    def _wait_ready(self, hosts: list[_Hosted], timeout_s: float) -> None:
        while not all(h.ready for h in hosts):
            self._poll(hosts)
            for h in hosts:
                if h.code is not None or h.lost:
                    raise RayLaunchError(f"{h.name} on node {h.node_ip} "
                                         f"{h.lost or f'exited with code {h.code}'} before it was "
                                         f"healthy; log {h.log_path}:\n{_tail(h.log_path)}")
                if not h.ready and time.monotonic() - h.started_at > timeout_s:
                    raise RayLaunchError(f"{h.name} on node {h.node_ip} not healthy after {timeout_s:g} s; "
                                         f"log {h.log_path}:\n{_tail(h.log_path)}")
            time.sleep(0.3)

    # ---- trainer ranks -----------------------------------------------------------------------
    def run_trainer_ranks(self, config_path: Path, engine_urls: list[str],
                          router_url: str | None) -> int:
        cfg = self.cfg
        n, share = cfg.actor_num_gpus_per_node, (ray_placement.COLOCATED_SHARE if cfg.colocate else 1.0)
        threads = cfg.trainer_cpu_threads or max(1, int(cfg.ray_cpus_per_component * share))
        ranks = [self._host(f"trainer rank {r}", 0, r, share, echo=True) for r in range(n)]
        master_port = self._call(ranks[0].actor, "free_port", ranks[0].node_ip, what=ranks[0].name)
        cmd = [sys.executable, "-m", "milepost.driver.worker", str(config_path), "--engine-urls", *engine_urls]
        if router_url:
            cmd += ["--router-url", router_url]
        for r, h in enumerate(ranks):
            env = {"MASTER_ADDR": ranks[0].node_ip, "MASTER_PORT": str(master_port), "RANK": str(r),
                   "WORLD_SIZE": str(n), "LOCAL_RANK": "0",  # Ray shows each rank its own GPU only
                   NODE_ADDRESS_ENV: h.node_ip, "OMP_NUM_THREADS": str(threads)}
            self._start(h, cmd, env, None)
        with _sigterm_as_exit(), noted_ctrl_c() as ctrl_c:
            return self._watch(ranks, ctrl_c)

    def _watch(self, ranks: list[_Hosted], ctrl_c: noted_ctrl_c) -> int:
        """Like LocalLauncher._wait_all: the first rank to fail, or any engine / the router
        dying, stops the run with a message naming it."""
        others = [h for h in self.hosted if h not in ranks]
        try:
            while True:
                self._poll(self.hosted)
                if all(h.code == 0 for h in ranks):
                    return 0
                for h in others:  # started with wait=False: rank 0 waits for them, within limits
                    if h.url and not h.ready and time.monotonic() - h.started_at > 600 and not h.lost:
                        h.lost = "was not healthy 600 s after its start"
                dead = self._dead(others)
                if dead:
                    log.error("%s; stopping the trainer ranks", dead)
                    return 1
                failed = [h for h in ranks if h.lost or h.code not in (None, 0)]
                if failed:
                    h = failed[0]
                    why = h.lost or _how_it_ended(h.code)
                    dead = self._dead(others)
                    log.error("%s (node %s) %s; stopping the others; its log: %s%s", h.name,
                              h.node_ip, why, h.log_path, f" ({dead})" if dead else "")
                    return 1 if h.lost else (h.code if h.code > 0 else 128 - h.code)
                time.sleep(0.5)
        except BaseException as e:
            if ctrl_c.seen or isinstance(e, (KeyboardInterrupt, SystemExit)):
                log.warning("interrupted (%s); stopping the trainer ranks and engines",
                            "Ctrl-C" if ctrl_c.seen or isinstance(e, KeyboardInterrupt) else "SIGTERM")
            raise

    def _dead(self, hosts: list[_Hosted]) -> str:
        lines = []
        for h in hosts:
            if h.lost or h.code is not None:
                how = h.lost or f"stopped with exit code {h.code}"
                tail = _tail(h.log_path, 800)
                lines.append(f"{h.name} ({h.url or '-'}, node {h.node_ip}) {how} while the run was "
                             f"going; its log: {h.log_path}" + (f"; last lines:\n{tail}" if tail else ""))
        return "\n".join(lines)

    def _poll(self, hosts: list[_Hosted]) -> None:
        """One status call to each live actor; new log bytes go to run_dir/logs (and stdout)."""
        live = [h for h in hosts if not h.lost and h.code is None]
        refs = [h.actor.poll.remote(h.offset) for h in live]
        for h, ref in zip(live, refs):
            try:
                code, ready, chunk = self.ray.get(ref, timeout=_RPC_TIMEOUT_S)
            except self.ray.exceptions.RayActorError as e:
                h.lost = f"lost its Ray actor ({str(e).splitlines()[0][:200]})"
                continue
            self._append(h, chunk)
            h.ready = ready
            if code is not None:  # drain what it wrote last before calling it done
                while chunk:
                    _, _, chunk = self.ray.get(h.actor.poll.remote(h.offset), timeout=_RPC_TIMEOUT_S)
                    self._append(h, chunk)
                h.code = code

    def _append(self, h: _Hosted, chunk: bytes) -> None:
        if not chunk:
            return
        h.offset += len(chunk)
        h.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(h.log_path, "ab") as f:
            f.write(chunk)
        if h.echo:
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every component (their last output still reaches the logs), kill the actors,
        free the placement groups, leave the cluster."""
        ray = self.ray
        stops = [(h, h.actor.stop.remote()) for h in reversed(self.hosted) if not h.lost]
        for h, ref in stops:
            try:
                ray.get(ref, timeout=60)
                self._poll([h])
                ray.get(h.actor.remove_log.remote(), timeout=30)  # the node's copy
            except Exception as e:  # noqa: BLE001 (dead or stuck actor: ray.kill below)
                log.debug("stopping %s: %s", h.name, e)
        for h in self.hosted:
            ray.kill(h.actor, no_restart=True)
        self.hosted.clear()
        from ray.util import remove_placement_group

        for pg in self._groups:
            if pg is not None:
                remove_placement_group(pg)
        self._groups.clear()
        if ray.is_initialized():
            ray.shutdown()
        super().close()


def with_run_api_key(cfg: Any) -> Any:
    """cfg, with a random per-run API key when none is set: under Ray every server binds its
    node's address, so none may answer without the key (the resolved config keeps it, mode
    0600, so a resumed run uses the same one)."""
    if cfg.api_key:
        return cfg
    return cfg.model_copy(update={"api_key": secrets.token_hex(32)})


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayLaunchError("--launcher ray needs Ray: pip install 'milepost[ray]'") from e
    gone = ray_placement.missing_api()
    if gone:
        raise RayLaunchError(f"--launcher ray: Ray {ray.__version__} lacks {', '.join(gone)}; "
                             "install a newer one: pip install -U 'milepost[ray]'")
    return ray


def _check_reachable(address: str) -> None:
    """Fail in seconds, not after Ray's own minute of retries, when the head does not answer."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RayLaunchError(f"--ray-address {address!r} is not HOST:PORT (the head's GCS port) or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except OSError as e:
        raise RayLaunchError(f"--ray-address {address}: the Ray head is unreachable ({e}); is "
                             "`ray start --head --port PORT` running there?") from e


def _node_resources(ray: Any) -> str:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return "; ".join(f"{n['NodeManagerAddress']}: " + ", ".join(
        f"{k} {v:g}" for k, v in sorted(n.get("Resources", {}).items())
        if not k.startswith(("node:", "memory", "object_store"))) for n in nodes)


def _with_host(cmd: list[str], host: str) -> list[str]:
    """The local launcher's command with its --host replaced by the node's address."""
    out = list(cmd)
    out[out.index("--host") + 1] = host
    return out


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _tail(path: Path, n_chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n_chars:].strip()
    except OSError:
        return ""
