"""One trainer rank: `python -m milepost.driver.worker CONFIG --engine-urls ...` (started by a launcher).

Joins the default process group from the launcher's environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), then runs the sync loop. Errors whose message says everything (bad input, a
component gone) are logged as one line and exit 1; anything else keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch.distributed as dist

from milepost.auth import use_api_key
from milepost.config import load_config

log = logging.getLogger("milepost.driver.worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="milepost.driver.worker")
    parser.add_argument("config", help="the run's config.resolved.toml")
    parser.add_argument("--engine-urls", nargs="*", default=[])
    parser.add_argument("--router-url", default=None)
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    use_api_key(cfg.api_key)  # every client this rank makes sends it (milepost/auth.py)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress

    from milepost.data.source import DatasetError
    from milepost.driver import fully_async, sync
    from milepost.driver.preflight import RunError
    from milepost.driver.runtime import Runtime
    from milepost.rollout.client import EngineError
    from milepost.rollout.generate import RolloutError
    from milepost.train.finite import TrainingDivergedError
    from milepost.weights.transport import TransportError

    from milepost.launch.rendezvous import init_default_group

    init_default_group("nccl" if cfg.device == "cuda" else "gloo")  # rank 0 listens on MASTER_ADDR only
    rt = None
    try:
        if cfg.fully_async:
            from milepost.driver.async_runtime import FullyAsyncRuntime

            rt = FullyAsyncRuntime(cfg, args.engine_urls, args.router_url)
            fully_async.train_loop(rt)
        else:
            rt = Runtime(cfg, args.engine_urls, args.router_url)
            sync.train_loop(rt)
    except (RunError, DatasetError, RolloutError, TransportError, EngineError,
            TrainingDivergedError) as e:
        # No destroy_process_group: the other ranks may be blocked in a collective; exiting
        # ends this rank's part, and the launcher stops the others.
        log.error("rank %d: %s", dist.get_rank(), e)
        return 1
    except RuntimeError as e:
        if dist.get_rank() == 0 or not _peer_gone(e):
            raise
        # A consequence, not a cause: the rank that failed first said why; no second traceback.
        log.error("rank %d: stopped because another rank is gone (%s)", dist.get_rank(),
                  str(e).splitlines()[0][:200])
        return 1
    finally:
        if rt is not None:
            rt.close()
    dist.destroy_process_group()
    return 0


def _peer_gone(e: RuntimeError) -> bool:
    """The error of a collective whose peer process exited (gloo says it this way)."""
    return any(m in str(e) for m in ("closed by peer", "reset by peer", "Broken pipe"))


def _exit(code: int) -> None:
    """Leave without interpreter teardown. A gloo worker thread may still be releasing a finished
    collective's tensors when Python finalizes; it then cannot take the GIL and the process
    aborts ("terminate called without an active exception", seen at the end of a resumed run
    with nothing left to train). Everything this rank owns was closed in `main`."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
