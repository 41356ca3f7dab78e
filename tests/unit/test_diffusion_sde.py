"""The SDE sampler and its log-probs (milepost/diffusion/sde.py) against closed forms."""

from __future__ import annotations

import math

import pytest
import torch

from milepost.diffusion.model import DiTConfig, TinyDiT
from milepost.diffusion.sde import gaussian_logprob, sample, timesteps, transition

torch.set_num_threads(1)


class _Exact(TinyDiT):
    """The exact velocity field of a data set holding one image X: v(x, t) = (x - X) / t."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__(DiTConfig(dim=8, depth=1, heads=2))
        self.target = target

    def forward(self, x, t, labels=None, cond=None):
        return (x - self.target) / t.reshape(-1, 1, 1, 1)


@pytest.mark.parametrize("noise_level", [0.01, 0.7])
def test_sampling_reaches_the_only_image(noise_level: float) -> None:
    target = torch.rand(1, 3, 32, 32) * 2 - 1
    traj = sample(_Exact(target), torch.zeros(4, dtype=torch.long), num_steps=20, guidance=1.0,
                  noise_level=noise_level, seed=0)
    assert traj.latents.shape == (4, 21, 3, 32, 32) and traj.log_probs.shape == (4, 20)
    err = (traj.latents[:, -1] - target).abs().mean()
    assert err < 0.05, err  # the SDE keeps the ODE's marginals: it still ends at X


def test_logprob_is_the_gaussian_density() -> None:
    x = torch.randn(2, 3, 4, 4)
    v = torch.randn(2, 3, 4, 4)
    mean, std = transition(x, v, torch.tensor(0.5), torch.tensor(0.4), 0.9, 0.7)
    x_next = mean + std * torch.randn_like(mean)
    lp = gaussian_logprob(x_next, mean, std)
    ref = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x_next).mean(dim=(1, 2, 3))
    torch.testing.assert_close(lp, ref)
    # the drift: ODE step plus the score term sigma^2/(2t) (x + (1-t) v), dt = -0.1
    sigma2 = 0.49 * 0.5 / 0.5
    torch.testing.assert_close(mean, x + (v + sigma2 / 1.0 * (x + 0.5 * v)) * -0.1)
    assert math.isclose(float(std), math.sqrt(sigma2) * math.sqrt(0.1), rel_tol=1e-6)


def test_grid_and_shift() -> None:
    t = timesteps(4)
    assert t[0] == 1 and t[-1] == 0 and torch.all(t[1:] < t[:-1])
    assert torch.all(timesteps(4, shift=3.0)[1:-1] > t[1:-1])  # shift > 1 spends more steps at high noise
