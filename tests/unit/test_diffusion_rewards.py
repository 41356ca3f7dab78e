"""Image rewards (milepost/diffusion/rewards.py): built-ins behave as defined; bad results from a
reward function are counted and never trained on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from milepost.diffusion.rewards import (
    brightness,
    checked_rewards,
    colourfulness,
    jpeg_compressibility,
    make_reward,
    shape_brightness,
)


def _flat(value: float, n: int = 2) -> np.ndarray:
    return np.full((n, 3, 32, 32), value * 2 - 1, dtype=np.float32)


def test_brightness_peaks_at_target() -> None:
    labels = np.zeros(2)
    assert np.allclose(brightness(_flat(0.65), labels, target=0.65), 1.0)
    assert np.allclose(brightness(_flat(0.5), labels, target=0.65), 1 - 0.15 / 0.25)
    assert np.allclose(brightness(_flat(0.0), labels, target=0.65), 0.0)


def test_shape_brightness_counts_only_the_shape() -> None:
    from milepost.diffusion.shapes import render

    labels = np.zeros(3)
    small = render(0, np.array([1.0, 1.0, 1.0], np.float32), 16, 16, 5)
    large = render(1, np.array([1.0, 1.0, 1.0], np.float32), 16, 16, 12)
    dark = render(1, np.array([0.0, 0.0, 0.2], np.float32), 16, 16, 12)
    got = shape_brightness(np.stack([small, large, dark]), labels)
    # a white shape scores 1 whatever its size; a whole-image mean (brightness) would favour the large one
    assert np.allclose(got[:2], 1.0) and np.isclose(got[2], 0.114 * 0.2, atol=1e-6)
    assert shape_brightness(_flat(0.5), np.zeros(2)).tolist() == [0.0, 0.0]  # no shape drawn: nothing to score
    assert make_reward("shape_brightness") is shape_brightness


def test_colourfulness_and_compressibility_order_images() -> None:
    labels = np.zeros(2)
    grey = _flat(0.5)
    red = grey.copy()
    red[:, 0] = 1.0
    red[:, 1:] = -1.0
    assert np.allclose(colourfulness(grey, labels), 0.0) and np.allclose(colourfulness(red, labels), 0.3 * math.sqrt(1.25))  # mu_rg 1, mu_yb 0.5
    noise = np.random.default_rng(0).uniform(-1, 1, size=(2, 3, 32, 32)).astype(np.float32)
    assert np.all(jpeg_compressibility(grey, labels) > jpeg_compressibility(noise, labels))


def _nan_reward(images: np.ndarray, labels: np.ndarray) -> list[float]:
    return [math.nan] + [1.0] * (len(labels) - 1)


def _short_reward(images: np.ndarray, labels: np.ndarray) -> list[float]:
    return [1.0]


def test_bad_rewards_are_counted_not_trained_on(caplog: pytest.LogCaptureFixture) -> None:
    images, labels = _flat(0.5, 4), np.zeros(4, dtype=np.int64)
    fn = make_reward(f"{__name__}:_nan_reward")
    rewards, valid = checked_rewards(fn, images, labels, "nan_reward")
    assert valid.tolist() == [False, True, True, True] and np.isfinite(rewards).all()
    rewards, valid = checked_rewards(_short_reward, images, labels, "short_reward")
    assert not valid.any()
    assert "shape (1,) for 4 images" in caplog.text and "non-finite" in caplog.text
    with pytest.raises(ValueError, match="--reward-fn"):
        make_reward("no_such_module_xyz:fn")


def test_shape_classifier_reward_pays_for_the_requested_shape(tmp_path) -> None:
    """The OCR-free built-in: milepost's own classifier (trained here on the synthetic shapes, as
    `prepare` does, briefly) loaded by path; the reward is its probability of the requested class."""
    import torch

    from milepost.diffusion.classifier import save_classifier, train_classifier
    from milepost.diffusion.shapes import make_dataset

    torch.set_num_threads(1)
    clf, held_out = train_classifier(steps=60, seed=0)
    assert held_out > 0.9
    fn = make_reward("shape_classifier", classifier_path=save_classifier(clf, tmp_path / "clf"))
    images, labels = make_dataset(30, seed=7)
    right = checked_rewards(fn, images, labels, "shape_classifier")[0]
    wrong = checked_rewards(fn, images, (labels + 1) % 3, "shape_classifier")[0]
    assert right.shape == (30,) and np.all((right >= 0) & (right <= 1))
    assert right.mean() > 0.8 and wrong.mean() < 0.2 and np.all(right > wrong)
    with pytest.raises(ValueError, match="classifier-path"):
        make_reward("shape_classifier")
