"""Run the tiny demo's RL N times on one base model and print the spread of its learning curve.

    python -m milepost.demo.prepare runs/tiny-demo
    python benchmarks/demo_rl_spread.py runs/tiny-demo --runs 10 [--fully-async] --log spread.jsonl
    python benchmarks/demo_rl_spread.py runs/tiny-demo --recipe recipes/opd_demo.toml --num-rollout 5 \
        --log opd.jsonl -- --opd-teacher-checkpoint runs/opd-teacher

Arguments after `--` go to every `milepost train` command as they are (a learning test's own flags).

Each run is exactly the e2e tests' command (tests/e2e/test_demo_rl.py, test_demo_fully_async.py):
`milepost train recipes/tiny_demo.toml` for `--num-rollout` rollouts, one after another (never in
parallel: they would share the cores), with passive OpenMP waits as in the tests. Per run it prints the first rollout's mean reward, the mean
of the last five, the held-out greedy evaluation at the end and the wall time, appending the same
to `--log` as it goes; at the end the mean, standard deviation, min and max of each number. The
test bounds are set from these numbers (their docstrings say how).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from milepost.launch.process import openmp_defaults

ROOT = Path(__file__).resolve().parents[1]


def train_cmd(work: Path, run_dir: Path, num_rollout: int, fully_async: bool,
              recipe: Path = ROOT / "recipes" / "tiny_demo.toml", extra: tuple[str, ...] = ()) -> list[str]:
    """The e2e tests' `milepost train` command on a `prepare` output `work`."""
    cmd = [sys.executable, "-m", "milepost", "train", str(recipe),
           "--hf-checkpoint", str(work / "base_model"), "--prompt-data", str(work / "rl_prompts.jsonl"),
           "--eval-prompt-data", str(work / "eval_prompts.jsonl"), "--run-dir", str(run_dir),
           "--num-rollout", str(num_rollout), "--save-hf-at-end", "false"]
    return cmd + (["--eval-interval", "10", "--fully-async"] if fully_async else []) + list(extra)


def summarize(run_dir: Path) -> dict:
    """First reward, mean of the last five, every reward, the last evaluation, of one run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in records]
    evals = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]
    return {"first": rewards[0], "last5": sum(rewards[-5:]) / 5, "final_eval": evals[-1] if evals else None,
            "rewards": [round(x, 4) for x in rewards]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path, help="a `python -m milepost.demo.prepare` output directory")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--num-rollout", type=int, default=20)
    ap.add_argument("--fully-async", action="store_true")
    ap.add_argument("--log", type=Path, default=None, help="append one JSON line per run")
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "tiny_demo.toml")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]  # after --: more `milepost train` arguments for every run
    rows = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            done = subprocess.run(train_cmd(args.work, Path(tmp) / "rl", args.num_rollout, args.fully_async,
                                            args.recipe, tuple(args.extra)),
                                  capture_output=True, text=True, check=False,
                                  env={**os.environ, **openmp_defaults()})  # as the tests run it
            row = {"run": i, "fully_async": args.fully_async, "seconds": round(time.perf_counter() - t0, 1),
                   "returncode": done.returncode}
            if done.returncode == 0:
                row.update(summarize(Path(tmp) / "rl"))
            else:
                row["error"] = done.stderr[-2000:]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.log:
            with args.log.open("a") as f:
                f.write(json.dumps(row) + "\n")
    ok = [r for r in rows if r["returncode"] == 0]
    print(f"{len(ok)} of {len(rows)} runs finished")
    for key in ("first", "last5", "final_eval", "seconds"):
        v = [r[key] for r in ok if r.get(key) is not None]
        if len(v) >= 2:
            print(f"  {key}: mean {statistics.mean(v):.3f} std {statistics.stdev(v):.3f} "
                  f"min {min(v):.3f} max {max(v):.3f}  {[round(x, 3) for x in v]}")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
