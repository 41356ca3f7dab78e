"""Flow-GRPO's SDE sampler for rectified-flow models: each step's latent and transition log-prob.

Convention (SD3): x_t = (1 - t) x0 + t noise, v = noise - x0, sampling runs t = 1 -> 0. The
reverse-time SDE with the same marginals as the ODE (Flow-GRPO, eq. 9) discretized by Euler-
Maruyama gives a Gaussian transition x_next ~ N(mean, std^2) with
    sigma_t = a * sqrt(t / (1 - t)),  mean = x + [v + sigma_t^2 / (2t) * (x + (1 - t) v)] dt,
    std = sigma_t * sqrt(-dt),  dt = t_next - t < 0,
and t = 1 in sigma_t's denominator replaced by the grid's second point (as Flow-GRPO does).
Deviation: the last step (to t = 0) takes the mean, no noise (log-prob recorded as 0, never
trained on), so images carry no leftover sampling noise. The log-prob is the Gaussian log-density averaged over pixels (Flow-GRPO's reduction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from milepost.diffusion.model import TinyDiT

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def timesteps(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """The grid t_0 = 1 > ... > t_num_steps = 0 ([num_steps + 1], float32), SD3's time shift applied."""
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    t = shift * t / (1 + (shift - 1) * t)
    return t.float()


def velocity(model: TinyDiT, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
             null: torch.Tensor | None, guidance: float) -> torch.Tensor:
    """v [B,C,H,W] at time t (scalar or [B]); with guidance > 1 and a null condition, classifier-free
    guidance v_u + w (v_c - v_u) from one batched forward of both halves."""
    b = x.shape[0]
    tt = t.expand(b) if t.dim() == 0 else t
    if null is None or guidance == 1.0:
        return model(x, tt, cond=cond)
    both = model(torch.cat([x, x]), torch.cat([tt, tt]), cond=torch.cat([cond, null.expand(b, -1)]))
    v_c, v_u = both[:b], both[b:]
    return v_u + guidance * (v_c - v_u)


def transition(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor, t_max: float,
               noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean [B,C,H,W], std [B,1,1,1] or scalar) of the Gaussian step from x at t to t_next."""
    t = t.reshape(-1, *([1] * (x.dim() - 1))) if t.dim() else t
    t_next = t_next.reshape(-1, *([1] * (x.dim() - 1))) if t_next.dim() else t_next
    dt = (t_next - t).to(torch.float32)
    sigma = noise_level * torch.sqrt(t / (1 - torch.clamp(t, max=t_max)))
    mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
    return mean, sigma * torch.sqrt(-dt)


def gaussian_logprob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of x_next under N(mean, std^2), averaged over every dim but the batch. [B]"""
    lp = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, x_next.dim())))


@dataclass
class Trajectory:
    """What one batch of SDE sampling recorded. latents: [B, S+1, C, H, W] (x_t at every grid point,
    latents[:, -1] the images), log_probs: [B, S], timesteps: [S+1]."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    images: torch.Tensor | None = None  # [B,3,H,W] decoded by a latent model's VAE; None: latents[:, -1] are the images


@torch.no_grad()
def sample(model: TinyDiT, labels: torch.Tensor, *, num_steps: int, guidance: float, noise_level: float,
           seed: int, shift: float = 1.0) -> Trajectory:
    """SDE sampling of len(labels) images conditioned on `labels`, recording every step.

    The class embedding is computed once per call (a microgroup shares it). Noise comes from one
    generator seeded by `seed`, so a call is repeatable given the same batch."""
    device = next(model.parameters()).device
    cfg = model.config
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b = labels.shape[0]
    grid = timesteps(num_steps, shift).to(device)
    t_max = float(grid[1]) if num_steps > 1 else 0.5
    cond = model.condition(labels.to(device))
    null = model.condition(torch.tensor([cfg.num_classes], device=device)) if guidance != 1.0 else None
    shape = (b, cfg.channels, cfg.image_size, cfg.image_size)
    x = torch.randn(shape, generator=gen).to(device)
    latents, log_probs = [x], []
    for i in range(num_steps):
        v = velocity(model, x, grid[i], cond, null, guidance)
        mean, std = transition(x, v, grid[i], grid[i + 1], t_max, noise_level)
        if i == num_steps - 1 and num_steps > 1:  # the last step lands on t = 0 without noise
            x = mean
            log_probs.append(torch.zeros(b, device=device))
        else:
            x = mean + std * torch.randn(shape, generator=gen).to(device)
            log_probs.append(gaussian_logprob(x, mean, std))
        latents.append(x)
    return Trajectory(torch.stack(latents, 1).float().cpu(), torch.stack(log_probs, 1).float().cpu(), grid.cpu())
