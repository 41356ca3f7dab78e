"""The three diffusion objectives, each a loss over one micro-batch of a rollout.

- Flow-GRPO (Liu et al. 2025): re-score the recorded SDE transitions at the chosen steps under
  the current model; clipped ratio of transition probabilities times group-normalized
  advantages, plus the closed-form KL of the two Gaussian steps to the reference model.
- DiffusionNFT (Zheng et al. 2025): forward-process training on the rollout's clean images. With
  r in [0, 1] from the advantage (r = 0.5 + 0.5 clip(A, -1, 1)), the implicit positive policy
  v+ = (1 - beta) v_old + beta v_theta and negative v- = (1 + beta) v_old - beta v_theta are fit
  to the flow-matching target: r ||v+ - v||^2 + (1 - r) ||v- - v||^2, plus (--nft-kl-coef) the
  squared velocity gap to the reference model. Deviation: v_old is the rollout's model itself (no
  EMA of old policies) and no adaptive loss weighting.
- SFT: the flow-matching loss on data images (milepost/diffusion/base_model.py).
"""

from __future__ import annotations

import torch

from milepost.diffusion.model import TinyDiT
from milepost.diffusion.sde import gaussian_logprob, transition, velocity


def flow_grpo_step_loss(
    model: TinyDiT, ref: TinyDiT | None, *, x: torch.Tensor, x_next: torch.Tensor, t: torch.Tensor,
    t_next: torch.Tensor, t_max: float, old_logp: torch.Tensor, adv: torch.Tensor, labels: torch.Tensor,
    guidance: float, noise_level: float, eps_clip: float, kl_coef: float, null_label: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss (scalar, mean over the B samples) at one denoising step; detached stats for metrics.

    x, x_next: [B,C,H,W] recorded latents at t and t_next; old_logp, adv: [B]."""
    null_id = torch.tensor([null_label], device=x.device)
    cond = model.condition(labels)
    null = model.condition(null_id) if guidance != 1.0 else None
    v = velocity(model, x, t, cond, null, guidance)
    mean, std = transition(x, v, t, t_next, t_max, noise_level)
    logp = gaussian_logprob(x_next, mean, std)
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    policy = torch.maximum(unclipped, clipped).mean()
    loss, kl = policy, torch.zeros((), device=x.device)
    if ref is not None and kl_coef > 0:
        with torch.no_grad():
            ref_null = ref.condition(null_id) if guidance != 1.0 else None
            v_ref = velocity(ref, x, t, ref.condition(labels), ref_null, guidance)
            mean_ref, _ = transition(x, v_ref, t, t_next, t_max, noise_level)
        kl = (((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * std.reshape(-1) ** 2)).mean()
        loss = loss + kl_coef * kl
    stats = {"policy_loss": policy.detach(), "kl": kl.detach(),
             "ratio": ratio.detach().mean(), "clipfrac": ((ratio - 1).abs() > eps_clip).float().mean().detach(),
             "logp_diff_abs": (logp - old_logp).abs().mean().detach()}
    return loss, stats


def nft_optimality(adv: torch.Tensor) -> torch.Tensor:
    """DiffusionNFT's r in [0, 1] from normalized advantages [B]."""
    return 0.5 + 0.5 * torch.clamp(adv, -1.0, 1.0)


def nft_loss(model: TinyDiT, *, x0: torch.Tensor, labels: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
             v_old: torch.Tensor, r: torch.Tensor, beta: float, v_ref: torch.Tensor | None = None,
             kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The NFT loss (scalar) at times t [B] with fresh noise [B,C,H,W]; v_old: the rollout model's
    velocity at the same x_t (no grad). With v_ref (the reference model's velocity there) and
    kl_coef > 0, adds kl_coef * ||v_theta - v_ref||^2 (pixel mean): DiffusionNFT's KL to the
    reference for flow models (the squared velocity gap, Girsanov's KL between the two SDEs up
    to a time weight), which its code adds the same way."""
    tt = t.reshape(-1, 1, 1, 1)
    x_t = (1 - tt) * x0 + tt * noise
    target = noise - x0
    v = model(x_t, t, labels)
    v_pos = (1 - beta) * v_old + beta * v
    v_neg = (1 + beta) * v_old - beta * v
    pos = ((v_pos - target) ** 2).mean(dim=(1, 2, 3))
    neg = ((v_neg - target) ** 2).mean(dim=(1, 2, 3))
    loss = (r * pos + (1 - r) * neg).mean()
    kl = torch.zeros((), device=x0.device)
    if v_ref is not None and kl_coef > 0:
        kl = ((v - v_ref) ** 2).mean()
        loss = loss + kl_coef * kl
    return loss, {"nft_pos_mse": pos.mean().detach(), "nft_neg_mse": neg.mean().detach(),
                  "nft_r": r.mean().detach(), "kl": kl.detach()}


def group_advantages(rewards: torch.Tensor, valid: torch.Tensor, group_size: int, clip: float) -> torch.Tensor:
    """(r - group mean) / (group std + 1e-4) over the valid samples of each group; 0 for invalid
    samples and for groups with fewer than 2 valid samples. rewards, valid: [B] (B = groups * size)."""
    r = rewards.reshape(-1, group_size).double()
    m = valid.reshape(-1, group_size).double()
    n = m.sum(1, keepdim=True)
    mean = (r * m).sum(1, keepdim=True) / n.clamp(min=1)
    var = (((r - mean) ** 2) * m).sum(1, keepdim=True) / (n - 1).clamp(min=1)
    adv = (r - mean) / (var.sqrt() + 1e-4) * m * (n >= 2)
    return adv.clamp(-clip, clip).reshape(-1).float()
