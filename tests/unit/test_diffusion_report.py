"""`milepost report` on a diffusion run shows its before/after image grids (milepost/diffusion/grid.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from milepost.diffusion.grid import save_grid
from milepost.observe.report import write_report


def test_report_embeds_the_grids(tmp_path: Path) -> None:
    rows = [{"step": i, "rollout/reward_mean": 0.4 + 0.1 * i, "train/loss": 0.1, "train/grad_norm": 1.0} for i in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("before", "after"):
        save_grid(torch.zeros(3, 3, 8, 8), tmp_path / "grids" / f"{name}.png", cols=2)
    paths = write_report(tmp_path)
    assert {"grid_before.png", "grid_after.png"} <= {p.name for p in paths}
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "![grid_before](grid_before.png)" in summary and "![grid_after](grid_after.png)" in summary
