"""`milepost train RECIPE.toml` for a recipe with a `[diffusion]` table: parse, then run the loop."""

from __future__ import annotations

import argparse
import logging


def run_diffusion(parser: argparse.ArgumentParser, recipe: str | None, overrides: list[str], print_config: bool) -> int:
    from milepost.diffusion.config import TABLE_OF, load_diffusion_config
    from milepost.recipe import ConfigError, dump_toml

    try:
        cfg = load_diffusion_config(recipe, overrides)
    except ConfigError as err:
        parser.error(str(err))  # exits 2
    if print_config:
        print(dump_toml(cfg, TABLE_OF), end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = cfg.write_resolved()
    logging.getLogger("milepost.diffusion").info("run %s: resolved settings in %s", cfg.run_dir, path)
    from milepost.diffusion.driver import run

    return run(cfg)
