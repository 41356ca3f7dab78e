"""One metric of a run against its step, as a PNG: `python -m milepost.observe.loss_plot RUN_DIR`.

For runs whose `milepost report` panels (reward, response length...) do not apply, such as
`milepost sft` (default metric train/sft_loss).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def plot_metric(run_dir: str | Path, key: str, out: str | Path, title: str | None = None) -> Path:
    """Plot `key` from RUN_DIR/metrics.jsonl (steps as logged, 1-based on the axis) into `out`."""
    from matplotlib.figure import Figure  # no pyplot: no global state

    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    points = sorted((int(r["step"]) + 1, float(r[key])) for r in rows if key in r)
    if not points:
        raise ValueError(f"{path} has no {key!r} values")
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(key)
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.set_title(title or f"{key}: {points[0][1]:.3g} -> {points[-1][1]:.3g} over {len(points)} steps")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m milepost.observe.loss_plot", description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--key", default="train/sft_loss")
    ap.add_argument("--out", default=None, help="default RUN_DIR/report/<key>.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    out = args.out or Path(args.run_dir) / "report" / (args.key.replace("/", "_") + ".png")
    print(plot_metric(args.run_dir, args.key, out, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
