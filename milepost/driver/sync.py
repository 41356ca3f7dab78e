"""The synchronous RL loop: generate -> train -> save when due -> update weights -> offload.

`run` is what `milepost train` calls: it starts the run's components and the trainer ranks.
`train_loop` is what every trainer rank runs. Deviation from the issue's order: weights are sent
before the colocated trainer is offloaded, because the in-host handoff reads them where they are.
"""

from __future__ import annotations

import time

from milepost.config import TrainConfig
from milepost.driver.runtime import Runtime
from milepost.launch.local import LocalLauncher


def run(cfg: TrainConfig) -> int:
    config_path = cfg.write_resolved()
    with LocalLauncher(cfg, cfg.run_dir) as launch:
        engine_urls = [] if cfg.load_rollouts is not None else launch.start_engines()
        router_url = launch.start_router(engine_urls) if cfg.router and engine_urls else None
        return launch.run_trainer_ranks(config_path, engine_urls, router_url)


def train_loop(rt: Runtime) -> None:
    rt.push_resumed_weights()
    for step in rt.steps():
        start = time.perf_counter()
        rt.onload_trainer()
        groups = rt.generate(step)
        rt.train(groups)
        if rt.save_due(step):
            rt.save(step)
        rt.update_weights(step)
        if rt.cfg.colocate:
            rt.offload_trainer()
        rt.log(step, start)
