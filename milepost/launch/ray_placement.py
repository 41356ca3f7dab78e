"""What a run asks of a Ray cluster: the placement groups' bundles, and the refusals at start.

Pure functions of the run config and the cluster's resource totals, so the numbers in a refusal
(asked vs available) are tested without a cluster. Disaggregated: a trainer pool (one bundle per
rank) and an engine pool (one bundle per engine, `rollout_num_gpus_per_engine` GPUs each).
Colocated: one pool; trainer rank r and engine r share bundle r, each taking half of its GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The Ray API the launcher calls; a Ray without one of these is refused at start.
NEEDED_API = ("ray.util.placement_group", "ray.util.remove_placement_group",
              "ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy",
              "ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy",
              "ray.util.get_node_ip_address", "ray.util.list_named_actors")
COLOCATED_SHARE = 0.5  # of a bundle's GPU for each of its two actors


@dataclass
class Pool:
    """One placement group: its bundles and the strategy that spreads them over nodes."""

    name: str
    bundles: list[dict[str, float]] = field(default_factory=list)
    strategy: str = "PACK"

    def total(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for b in self.bundles:
            for k, v in b.items():
                out[k] = out.get(k, 0.0) + v
        return out


def parse_resources(entries: list[str] | None, setting: str) -> dict[str, float]:
    """["node1", "ssd=2"] -> {"node1": 1.0, "ssd": 2.0}; ValueError naming `setting` if malformed."""
    out: dict[str, float] = {}
    for entry in entries or []:
        name, eq, amount = entry.partition("=")
        name = name.strip()
        try:
            value = float(amount) if eq else 1.0
        except ValueError:
            value = -1.0
        if not name or value <= 0 or name in ("CPU", "GPU", "memory"):
            raise ValueError(f"--{setting.replace('_', '-')}: {entry!r} is not NAME or NAME=AMOUNT "
                             "of a custom resource (AMOUNT > 0; CPU and GPU come from the placement "
                             "settings)")
        out[name] = value
    return out


def pools(cfg: object, on_gpu: bool) -> tuple[Pool, Pool | None]:
    """(trainer pool, engine pool or None when colocated / external engines / none needed)."""
    ranks = cfg.actor_num_gpus_per_node
    trainer_extra = parse_resources(cfg.ray_trainer_resources, "ray_trainer_resources")
    engine_extra = parse_resources(cfg.ray_engine_resources, "ray_engine_resources")
    cpu = {"CPU": float(cfg.ray_cpus_per_component)}
    if cfg.colocate:  # rank r and engine r in bundle r
        bundle = {**cpu, **({"GPU": 1.0} if on_gpu else {}), **trainer_extra, **engine_extra}
        return Pool("colocated", [dict(bundle) for _ in range(ranks)], cfg.ray_placement_strategy), None
    trainer = Pool("trainer", [{**cpu, **({"GPU": 1.0} if on_gpu else {}), **trainer_extra}
                               for _ in range(ranks)], cfg.ray_placement_strategy)
    engines = None
    if cfg.engine_backend != "external" and cfg.load_rollouts is None:
        gpus = {"GPU": float(cfg.rollout_num_gpus_per_engine)} if on_gpu else {}
        engines = Pool("engines", [{**cpu, **gpus, **engine_extra}
                                   for _ in range(cfg.rollout_num_engines or 1)],
                       cfg.ray_placement_strategy)
    return trainer, engines


def refusals(cfg: object, on_gpu: bool, total: dict[str, float],
             available: dict[str, float]) -> list[str]:
    """Why the cluster cannot hold this run (asked vs available, per resource); [] when it can."""
    p: list[str] = []
    if cfg.colocate and cfg.rollout_num_gpus_per_engine != 1:
        p.append(f"--launcher ray with --colocate places engine r beside trainer rank r on one GPU; "
                 f"--rollout-num-gpus-per-engine {cfg.rollout_num_gpus_per_engine} is not supported "
                 "there yet: use 1, or drop --colocate")
    if cfg.colocate and (cfg.rollout_num_engines or 1) > cfg.actor_num_gpus_per_node:
        p.append(f"--launcher ray with --colocate: --rollout-num-engines {cfg.rollout_num_engines} "
                 f"exceeds the {cfg.actor_num_gpus_per_node} trainer ranks whose bundles they share")
    if p:
        return p
    trainer, engines = pools(cfg, on_gpu)
    asked: dict[str, float] = {}
    for pool in (trainer, engines):
        for k, v in (pool.total() if pool else {}).items():
            asked[k] = asked.get(k, 0.0) + v
    for name, want in sorted(asked.items()):
        have, free = total.get(name, 0.0), available.get(name, 0.0)
        if want > free:
            p.append(f"the Ray cluster lacks {name}: the run asks {_n(want)} ({_breakdown(name, trainer, engines)})"
                     f", the cluster has {_n(have)} of which {_n(free)} are free"
                     + _hint(name, have))
    return p  # a bundle too big for any one node is named when its placement group times out


def _breakdown(name: str, trainer: Pool, engines: Pool | None) -> str:
    parts = [f"{pool.name}: {len(pool.bundles)} x {_n(pool.bundles[0].get(name, 0.0))}"
             for pool in (trainer, engines) if pool and pool.bundles and pool.bundles[0].get(name)]
    return ", ".join(parts)


def _hint(name: str, have: float) -> str:
    if name == "GPU":
        return "; lower --actor-num-gpus-per-node / --rollout-num-engines, or add GPU nodes"
    if name == "CPU":
        return "; lower --ray-cpus-per-component, or start the nodes with more --num-cpus"
    if not have:
        return (f"; no node offers the custom resource {name!r} (ray start --resources "
                f"'{{\"{name}\": N}}'), or drop it from --ray-trainer-resources / --ray-engine-resources")
    return ""


def _n(x: float) -> str:
    return f"{x:g}"


def missing_api() -> list[str]:
    """The entries of NEEDED_API this Ray lacks ([] when all are there)."""
    import importlib

    gone = []
    for path in NEEDED_API:
        module, _, attr = path.rpartition(".")
        try:
            if not hasattr(importlib.import_module(module), attr):
                gone.append(path)
        except ImportError:
            gone.append(path)
    return gone
