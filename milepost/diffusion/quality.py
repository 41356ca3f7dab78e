"""The image-quality check of a diffusion RL run: the shape classifier on a fixed probe batch.

The rollout's own accuracy (16 images a step) swings by +-0.2 from step to step. The probe asks
the engine for the same labels, seeds and sampler settings every time (`--quality-probe` images,
classes balanced), so two checks differ only by the weights: the base model's check (before any
update) and a later one compare like with like (`quality/probe_accuracy`, `quality/probe_drop`).
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from milepost.diffusion.client import collect, final_images

PROBE_SEED = 20_261_203  # apart from the rollout seeds (numpy draws in driver.py)


def probe_groups(size: int, n_classes: int) -> list[tuple[int, int]]:
    """[(label, n)] with `size` images in all, spread evenly over the classes (the first ones get the rest)."""
    per, rest = divmod(size, n_classes)
    return [(c, per + (c < rest)) for c in range(n_classes) if per + (c < rest) > 0]


def probe_accuracy(url: str, classifier: torch.nn.Module, *, size: int, n_classes: int, params: dict,
                   fmt: str, image: tuple[int, int, int], seed: int = 0) -> float:
    """Fraction of the probe's images that the classifier assigns the class they were asked for."""
    groups = probe_groups(size, n_classes)
    seeds = [PROBE_SEED + seed * 1000 + c for c, _ in groups]

    def no_reward(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(len(labels)), np.ones(len(labels), dtype=bool)

    results, _ = asyncio.run(collect(url, groups, seeds=seeds, params=params, fmt=fmt, image=image,
                                     score=no_reward, pool=None))
    images = torch.from_numpy(np.concatenate([final_images(r) for r in results])).float()
    labels = torch.from_numpy(np.concatenate([r.labels for r in results])).long()
    with torch.no_grad():
        pred = classifier(images).argmax(-1)
    return float((pred == labels).float().mean())
