"""Write the demo's datasets and base model: `python -m milepost.demo.prepare OUT_DIR`.

OUT_DIR/rl_prompts.jsonl (RL prompts + labels), OUT_DIR/eval_prompts.jsonl (held-out prompts for
evaluation during training) and OUT_DIR/base_model/ (the HF directory `milepost serve` and
`milepost train` load; its demo_model.json says how many steps each phase took and every held-out
check). A complete OUT_DIR is reused as it is (its `prepare.json` records how it was made);
--force rebuilds it. Exits 1 with a message if the base model misses its intended regime.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

from milepost.demo.recipe import DemoModelError, DemoModelRecipe
from milepost.demo.task import OPERANDS, write_datasets

STAMP = "prepare.json"
N_PROMPTS = 4096
N_EVAL = 256
DATA_VERSION = 3  # bump when the task or the pass changes, so old OUT_DIRs are rebuilt


def _settings(recipe: DemoModelRecipe) -> dict:
    settings = {"version": DATA_VERSION, "n_prompts": N_PROMPTS, "n_eval": N_EVAL, "operands": list(OPERANDS),
                "model": asdict(recipe)}
    return json.loads(json.dumps(settings))  # as the stamp reads back (tuples become lists)


def prepare(
    out_dir: str | Path, *, seed: int = 0, force: bool = False, seconds_budget: float | None = None,
    log_every: int = 0,
) -> tuple[Path, Path]:
    """Build (or reuse) the demo data and base model in `out_dir`; returns (model dir, RL prompts)."""
    out_dir = Path(out_dir)
    model_dir, prompts = out_dir / "base_model", out_dir / "rl_prompts.jsonl"
    stamp = out_dir / STAMP
    recipe = DemoModelRecipe(seed=seed)
    settings = _settings(recipe)
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("settings") == settings:
        return model_dir, prompts
    t0 = time.perf_counter()
    if model_dir.exists():
        shutil.rmtree(model_dir)
    stamp.unlink(missing_ok=True)
    from milepost.demo.base_model import INFO_FILE, make_demo_model  # torch: only when building

    write_datasets(out_dir, n_prompts=N_PROMPTS, n_eval=N_EVAL, seed=seed)
    make_demo_model(model_dir, seconds_budget=seconds_budget, recipe=recipe, log_every=log_every)
    info = json.loads((model_dir / INFO_FILE).read_text())
    stamp.write_text(
        json.dumps({"settings": settings, "seconds": round(time.perf_counter() - t0, 2), "model": info}, indent=2)
        + "\n"
    )
    return model_dir, prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m milepost.demo.prepare", description=__doc__)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR is complete")
    ap.add_argument(
        "--seconds-budget", type=float, default=0.0,
        help="fail if the supervised pass takes longer (default 0 = no limit: the phases' step caps bound the work, "
        "and a busy machine may need several times the idle time)",
    )
    ap.add_argument("--log-every", type=int, default=100, help="print the held-out check every N steps (0 = quiet)")
    args = ap.parse_args(argv)
    from milepost.launch.process import openmp_defaults

    os.environ.update(openmp_defaults())  # torch is not loaded yet (see milepost/demo/recipe.py)
    try:
        model_dir, prompts = prepare(
            args.out_dir, seed=args.seed, force=args.force, seconds_budget=args.seconds_budget or None,
            log_every=args.log_every,
        )
    except (DemoModelError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    info = json.loads((args.out_dir / STAMP).read_text())
    m = info["model"]
    print(
        f"base model {model_dir}: supervised pass {m['sft_seconds']}s ({m['drill_steps']} drill + "
        f"{m['tutor_steps']} tutor steps), sampled accuracy "
        f"{m['sampled_accuracy']:.3f} (estimates {m['estimate_rate']:.3f}, right when computing "
        f"{m['computing_accuracy']:.3f}); RL prompts {prompts}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
