"""The fully asynchronous RL loop (report section 2.2): engines generate while the trainer trains.

A background rollout worker keeps `max_inflight` trajectories generating into a bounded buffer;
each step takes whichever fresh groups are finished, trains, and updates the engines' weights
while they keep generating (paused only for the update itself). `milepost train --fully-async`
starts the components like the sync loop (`sync.run`); this is what every trainer rank runs.
"""

from __future__ import annotations

import time

from milepost.driver.async_runtime import FullyAsyncRuntime


def train_loop(rt: FullyAsyncRuntime) -> None:
    rt.push_resumed_weights()
    rt.start_rollout_worker()
    for step in rt.steps():
        start = time.perf_counter()
        groups = rt.take_batch(step)
        rt.train(groups)
        rt.update_weights(step)
        if rt.eval_due(step):
            rt.evaluate(step)
        rt.log(step, start)
        if rt.save_due(step):
            rt.save(step)
    rt.stop_rollout_worker()
