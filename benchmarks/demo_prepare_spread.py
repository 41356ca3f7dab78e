"""Build the demo's base model for several seeds at once and print where each landed.

    python benchmarks/demo_prepare_spread.py --seeds 0-7 --jobs 8 --out /tmp/spread

Each seed runs `python -m milepost.demo.prepare OUT/seed-S --seed S --force` in its own process
(torch threads: the demo's default of 2), so on a machine with 2 x jobs cores they do not slow each
other. Prints one row per seed (steps of each phase, held-out sampled accuracy, estimate rate,
right-when-computing, greedy accuracy, seconds) and a summary; `--json` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

KEYS = ("drill_steps", "tutor_steps", "sampled_accuracy", "estimate_rate", "computing_accuracy",
        "greedy_accuracy", "sft_seconds")


def parse_seeds(text: str) -> list[int]:
    """`0-7` or `0,3,5`."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-7")
    ap.add_argument("--jobs", type=int, default=1, help="prepare processes at a time")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    pending, running, rows = parse_seeds(args.seeds), {}, []
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < args.jobs:
            s = pending.pop(0)
            log = open(args.out / f"seed-{s}.log", "w")  # noqa: SIM115 (closed when the seed ends)
            cmd = [sys.executable, "-m", "milepost.demo.prepare", str(args.out / f"seed-{s}"),
                   "--seed", str(s), "--force", "--seconds-budget", "0"]
            running[s] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
        for s, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[s]
            stamp = args.out / f"seed-{s}" / "prepare.json"
            if proc.returncode == 0:
                m = json.loads(stamp.read_text())["model"]
                row = {"seed": s, "ok": True, **{k: m[k] for k in KEYS}}
            else:
                tail = (args.out / f"seed-{s}.log").read_text().strip().splitlines()[-1:]
                row = {"seed": s, "ok": False, "error": tail[0] if tail else f"exit {proc.returncode}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
        time.sleep(0.5)
    ok = [r for r in rows if r["ok"]]
    print(f"{len(ok)} of {len(rows)} seeds landed in the intended regime, {time.perf_counter() - t0:.0f} s")
    for k in KEYS:
        if ok:
            v = [r[k] for r in ok]
            print(f"  {k}: min {min(v)} median {statistics.median(v)} max {max(v)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
