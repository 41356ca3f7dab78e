"""The synchronous RL loop: generate -> onload -> train -> update weights -> evaluate when due ->
log -> save when due -> offload.

`run` is what `milepost train` calls: it starts the run's components and the trainer ranks.
`train_loop` is what every trainer rank runs. Deviations from the issue's order: weights are sent
before the colocated trainer is offloaded, because the in-host handoff reads them where they are;
evaluation follows the update it measures, so its score lands in that step's metrics; and a step
is logged before it is saved, so every step a checkpoint holds is in metrics.jsonl (a run killed
in between redoes that step on resume, and its line is replaced).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from milepost.config import TrainConfig
from milepost.connectors.env import resolve_env
from milepost.driver.preflight import RunError, finished_checkpoint, preflight
from milepost.launch.local import LocalLauncher
from milepost.launch.process import ComponentStartError
from milepost.launch.ray import RayLauncher, with_run_api_key

if TYPE_CHECKING:  # the launcher never imports the trainer (torch, transformers: seconds)
    from milepost.driver.runtime import Runtime

log = logging.getLogger(__name__)


def run(cfg: TrainConfig) -> int:
    """Start everything, train, stop everything; the exit code (0 = every step done)."""
    if cfg.launcher == "ray":  # servers bind node addresses: never without a key
        cfg = with_run_api_key(cfg)
    try:  # --env: its prompts into the run directory, then ordinary --prompt-data / --reward-fn
        cfg = resolve_env(cfg)
    except (ValueError, ImportError) as e:
        log.error("%s", e)
        return 1
    config_path = cfg.write_resolved()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # health polls would flood the log
    try:
        preflight(cfg)
        if (done := finished_checkpoint(cfg)) is not None:
            log.info("every step of this run (--num-rollout %d) is in %s: nothing to train "
                     "(raise --num-rollout to go on)", cfg.num_rollout, done)
            return 0
        with (RayLauncher if cfg.launcher == "ray" else LocalLauncher)(cfg, cfg.run_dir) as launch:
            # Trainer ranks start while engines load, unless they share devices (colocated: an
            # engine sizes its KV cache from the free memory it sees) or a router must see
            # healthy engines first.
            overlap = not cfg.colocate and not cfg.router
            engine_urls = ([] if cfg.load_rollouts is not None
                           else launch.start_engines(wait=not overlap))
            router_url = launch.start_router(engine_urls) if cfg.router and engine_urls else None
            return launch.run_trainer_ranks(config_path, engine_urls, router_url)
    except (RunError, ComponentStartError) as e:  # the message says it all: no traceback
        log.error("%s", e)
        return 1


def train_loop(rt: Runtime) -> None:
    rt.push_resumed_weights()
    rt.offload_trainer()  # colocated: the engines get the device for the first rollout too
    for step in rt.steps():
        start = time.perf_counter()
        groups = rt.generate(step)  # the trainer is off the device while the engines generate
        rt.onload_trainer()
        rt.train(groups)
        rt.update_weights(step)
        if rt.eval_due(step):
            rt.evaluate(step)
        rt.log(step, start)
        if rt.save_due(step):
            rt.save(step)
        rt.offload_trainer()  # when --offload-train (default with --colocate)
