"""Train the tiny DiT on the synthetic shapes with the flow-matching loss (the SFT objective).

Rectified flow: x_t = (1 - t) x0 + t noise, target v = noise - x0, t from a logit-normal (SD3),
the class dropped to the null class 10% of the time so classifier-free guidance works.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from milepost.diffusion.model import DiTConfig, TinyDiT


def flow_matching_loss(model: TinyDiT, x0: torch.Tensor, labels: torch.Tensor, gen: torch.Generator,
                       label_dropout: float = 0.0) -> torch.Tensor:
    """Mean squared velocity error at a logit-normal t per image (the SFT loss). Scalar."""
    b = x0.shape[0]
    t = torch.sigmoid(torch.randn(b, generator=gen)).to(x0.device)
    noise = torch.randn(x0.shape, generator=gen).to(x0.device)
    if label_dropout > 0:
        drop = torch.rand(b, generator=gen).to(x0.device) < label_dropout
        labels = torch.where(drop, torch.full_like(labels, model.config.num_classes), labels)
    tt = t[:, None, None, None]
    x_t = (1 - tt) * x0 + tt * noise
    return F.mse_loss(model(x_t, t, labels), noise - x0)


def pretrain(images: np.ndarray, labels: np.ndarray, *, steps: int, seed: int = 0, batch: int = 64,
             lr: float = 2e-3, config: DiTConfig | None = None, log_every: int = 0) -> tuple[TinyDiT, dict]:
    """(model, info) after `steps` Adam steps of the flow-matching loss on (images, labels)."""
    torch.manual_seed(seed)
    model = TinyDiT(config or DiTConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    x_all, y_all = torch.from_numpy(images), torch.from_numpy(labels)
    t0, ema = time.perf_counter(), None
    for step in range(steps):
        idx = torch.from_numpy(rng.integers(0, len(x_all), size=batch))
        loss = flow_matching_loss(model, x_all[idx], y_all[idx], gen, label_dropout=0.1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = float(loss.detach())
        ema = value if ema is None else 0.98 * ema + 0.02 * value
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{steps} loss {ema:.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    return model.eval(), {"steps": steps, "final_loss_ema": round(ema or 0.0, 5),
                          "seconds": round(time.perf_counter() - t0, 1)}
