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
)


def _flat(value: float, n: int = 2) -> np.ndarray:
    return np.full((n, 3, 32, 32), value * 2 - 1, dtype=np.float32)


def test_brightness_peaks_at_target() -> None:
    labels = np.zeros(2)
    assert np.allclose(brightness(_flat(0.65), labels, target=0.65), 1.0)
    assert np.allclose(brightness(_flat(0.5), labels, target=0.65), 1 - 0.15 / 0.25)
    assert np.allclose(brightness(_flat(0.0), labels, target=0.65), 0.0)


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
