"""Image grids of a run (before / after) as PNG, for run directories and `milepost report`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only when drawing: `milepost report` imports this module
    import torch


def save_grid(images: torch.Tensor, path: str | Path, cols: int = 8, scale: int = 3) -> Path:
    """images [N,3,H,W] in [-1,1] as one PNG, `cols` per row, each pixel `scale`x`scale`."""
    import numpy as np
    import torch
    from PIL import Image

    x = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    n, h, w, c = x.shape
    rows = math.ceil(n / cols)
    canvas = np.full((rows * (h + 1) + 1, cols * (w + 1) + 1, c), 255, dtype=np.uint8)
    for i in range(n):
        r, k = divmod(i, cols)
        canvas[1 + r * (h + 1):1 + r * (h + 1) + h, 1 + k * (w + 1):1 + k * (w + 1) + w] = x[i]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).resize((canvas.shape[1] * scale, canvas.shape[0] * scale), Image.NEAREST).save(path)
    return path


def copy_grids(run_dir: str | Path, out: str | Path) -> list[Path]:
    """A diffusion run's grids/before.png and after.png copied into `out` as grid_before.png and
    grid_after.png (for `milepost report`); [] for runs without grids."""
    import shutil

    copied = []
    for name in ("before", "after"):
        src = Path(run_dir) / "grids" / f"{name}.png"
        if src.is_file():
            copied.append(Path(shutil.copyfile(src, Path(out) / f"grid_{name}.png")))
    return copied
