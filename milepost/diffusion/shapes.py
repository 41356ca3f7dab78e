"""The synthetic image set of the tiny diffusion model: one coloured shape on a grey background.

Three classes (circle, square, triangle) at 32x32 RGB in [-1, 1], random colour and size,
near the centre. Rendered with numpy from a seed, so the data set is a pure function of (n, seed).
"""

from __future__ import annotations

import numpy as np

CLASSES = ("circle", "square", "triangle")
SIZE = 32
JITTER = 1.0  # pixels
# Half-sizes as fractions of the image: large shapes keep circle, square and triangle distinct
# after a few minutes of CPU pretraining (0.2-0.38 gave a base model that drew its class 0.4 of the time).
R_MIN, R_MAX = 0.3, 0.38


def render(kind: int, colour: np.ndarray, cx: float, cy: float, r: float, size: int = SIZE) -> np.ndarray:
    """One image [3, size, size] in [-1, 1]: shape `kind` of `colour` (RGB in [0, 1]) centred at
    (cx, cy) with half-size r (pixels), on a mid-grey background."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = xx - cx, yy - cy
    if kind == 0:
        mask = dx * dx + dy * dy <= r * r
    elif kind == 1:
        mask = (np.abs(dx) <= r * 0.85) & (np.abs(dy) <= r * 0.85)
    else:  # upright triangle: below the top vertex, inside both slanted edges
        top, base = cy - r, cy + r * 0.8
        frac = (dy - (top - cy)) / (base - top)
        mask = (yy >= top) & (yy <= base) & (np.abs(dx) <= frac * r)
    img = np.full((3, size, size), 0.5, dtype=np.float32)
    img[:, mask] = colour[:, None]
    return img * 2.0 - 1.0


def make_dataset(n: int, seed: int, size: int = SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(images [n, 3, size, size] float32 in [-1, 1], labels [n] int64), balanced over CLASSES."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n, dtype=np.int64) % len(CLASSES)
    rng.shuffle(labels)
    images = np.empty((n, 3, size, size), dtype=np.float32)
    for i, kind in enumerate(labels):
        colour = rng.uniform(0.0, 1.0, size=3).astype(np.float32)
        while np.abs(colour - 0.5).max() < 0.25:  # keep the shape visible against the grey
            colour = rng.uniform(0.0, 1.0, size=3).astype(np.float32)
        # Near the centre (a few pixels of jitter): a model this small learns where shapes are fast.
        r = rng.uniform(size * R_MIN, size * R_MAX)
        cx, cy = size / 2 + rng.uniform(-JITTER, JITTER, size=2)
        images[i] = render(int(kind), colour, float(cx), float(cy), float(r), size)
    return images, labels
