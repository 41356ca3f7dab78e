"""Mean reward per rollout of several `milepost train` runs in one PNG (the objectives' demo evidence).

    python benchmarks/plot_objectives.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from matplotlib.figure import Figure

    out, runs = Path(argv[0]), [a.split("=", 1) for a in argv[1:]]
    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.add_subplot()
    for label, run_dir in runs:
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        points = sorted((int(r["step"]) + 1, r["rollout/reward_mean"]) for r in rows if "rollout/reward_mean" in r)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=f"{label} ({len(points)} rollouts)")
    ax.set_xlabel("rollout")
    ax.set_ylabel("mean reward (exact sum)")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("tiny demo: PPO (learned critic) and GSPO")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
