"""Image rewards: built-ins that need no download, `module:function`, and the checks on results.

A reward function takes images [B, 3, H, W] (float32 in [-1, 1], numpy) and labels [B] and
returns B finite floats. A result of the wrong shape, or a NaN/inf entry, is not trained on: its
samples are marked invalid and counted (`rollout/bad_rewards`), with a message naming the function.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from milepost.plugins import load_callable

log = logging.getLogger(__name__)
RewardFn = Callable[[np.ndarray, np.ndarray], "np.ndarray | list[float]"]
BRIGHTNESS_WIDTH = 0.25
# A pixel belongs to the drawn shape when some channel is this far from the grey background (in
# [0, 1] units): half the smallest offset the data set draws a shape with (shapes.py: 0.25).
FOREGROUND_MIN = 0.125


def _unit(images: np.ndarray) -> np.ndarray:
    return np.clip((images.astype(np.float32) + 1.0) / 2.0, 0.0, 1.0)


def brightness(images: np.ndarray, labels: np.ndarray, target: float = 0.65) -> np.ndarray:
    """1 at mean luminance (Rec. 601) == target, falling linearly to 0 at BRIGHTNESS_WIDTH away."""
    x = _unit(images)
    lum = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).mean(axis=(1, 2))
    return np.clip(1.0 - np.abs(lum - target) / BRIGHTNESS_WIDTH, 0.0, 1.0)


def shape_brightness(images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Mean luminance of the shape's pixels (those off the grey background); 0 for an empty image.

    Unlike `brightness` (the whole image's luminance), a brighter colour of the same shape earns it
    all and growing the shape earns nothing. Not hack-proof: a frame lit all over counts as one big
    shape (DiffusionNFT without a KL found that); the run's quality probe is what catches it."""
    x = _unit(images)
    lum = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    fg = np.abs(x - 0.5).max(axis=1) > FOREGROUND_MIN
    count = fg.sum(axis=(1, 2))
    return np.where(count > 0, (lum * fg).sum(axis=(1, 2)) / np.maximum(count, 1), 0.0)


def colourfulness(images: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Hasler and Suesstrunk's colourfulness (sigma_rgyb + 0.3 mu_rgyb), on [0, 1] pixels."""
    x = _unit(images)
    rg = x[:, 0] - x[:, 1]
    yb = 0.5 * (x[:, 0] + x[:, 1]) - x[:, 2]
    sigma = np.sqrt(rg.std(axis=(1, 2)) ** 2 + yb.std(axis=(1, 2)) ** 2)
    mu = np.sqrt(rg.mean(axis=(1, 2)) ** 2 + yb.mean(axis=(1, 2)) ** 2)
    return sigma + 0.3 * mu


def jpeg_compressibility(images: np.ndarray, labels: np.ndarray, quality: int = 95) -> np.ndarray:
    """Minus the JPEG size in kB at `quality` (DDPO's compressibility reward)."""
    from PIL import Image

    out = []
    for img in (_unit(images) * 255).round().astype(np.uint8).transpose(0, 2, 3, 1):
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        out.append(-buf.tell() / 1000.0)
    return np.asarray(out, dtype=np.float32)


def shape_classifier(images: np.ndarray, labels: np.ndarray, classifier: object) -> np.ndarray:
    """The classifier's probability of the class each image was conditioned on."""
    import torch

    with torch.no_grad():
        probs = torch.softmax(classifier(torch.from_numpy(np.ascontiguousarray(images))), dim=-1)  # type: ignore[operator]
    return probs[torch.arange(len(labels)), torch.from_numpy(np.asarray(labels))].numpy()


def make_reward(name: str, *, brightness_target: float = 0.65, classifier_path: Path | None = None) -> RewardFn:
    """The reward function a run's settings name (a built-in, or module:function)."""
    if name == "brightness":
        return partial(brightness, target=brightness_target)
    if name == "shape_brightness":
        return shape_brightness
    if name == "colourfulness":
        return colourfulness
    if name == "jpeg_compressibility":
        return jpeg_compressibility
    if name == "shape_classifier":
        from milepost.diffusion.classifier import load_classifier

        if classifier_path is None:
            raise ValueError("--reward-fn shape_classifier needs --classifier-path")
        return partial(shape_classifier, classifier=load_classifier(classifier_path))
    return load_callable(name, "--reward-fn")


def checked_rewards(fn: RewardFn, images: np.ndarray, labels: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(rewards [B] float64, valid [B] bool). A result that is not B numbers invalidates the whole
    batch; NaN / inf entries invalidate their samples. Either is logged with the function's name."""
    b = len(labels)
    try:
        raw = np.asarray(fn(images, labels), dtype=np.float64)
    except Exception as e:  # noqa: BLE001 - a user's function may fail in any way; its batch is not trained on
        log.warning("reward %s raised %s: %s; %d samples not trained on", name, type(e).__name__, e, b)
        return np.zeros(b), np.zeros(b, dtype=bool)
    if raw.shape != (b,):
        log.warning("reward %s returned shape %s for %d images (want (%d,)); batch not trained on",
                    name, raw.shape, b, b)
        return np.zeros(b), np.zeros(b, dtype=bool)
    valid = np.isfinite(raw)
    if not valid.all():
        log.warning("reward %s returned %d non-finite values of %d; those samples are not trained on",
                    name, int((~valid).sum()), b)
    return np.where(valid, raw, 0.0), valid
