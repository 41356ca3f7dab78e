"""One trainer rank: `python -m milepost.driver.worker CONFIG --engine-urls ...` (started by a launcher).

Joins the default process group from the launcher's environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE), then runs the sync loop.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch.distributed as dist

from milepost.config import load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="milepost.driver.worker")
    parser.add_argument("config", help="the run's config.resolved.toml")
    parser.add_argument("--engine-urls", nargs="*", default=[])
    parser.add_argument("--router-url", default=None)
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress

    from milepost.driver.runtime import Runtime
    from milepost.driver.sync import train_loop

    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo")
    rt = Runtime(cfg, args.engine_urls, args.router_url)
    try:
        train_loop(rt)
    finally:
        rt.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
