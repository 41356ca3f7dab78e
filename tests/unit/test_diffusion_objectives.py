"""Diffusion objectives (milepost/diffusion/objectives.py): group-normalized advantages that skip
invalid samples, Flow-GRPO's ratio at the rollout's own weights, the KL to an identical reference,
and DiffusionNFT reducing to the flow-matching loss at r = 1, beta = 1."""

from __future__ import annotations

import torch

from milepost.diffusion.model import DiTConfig, TinyDiT
from milepost.diffusion.objectives import (
    flow_grpo_step_loss,
    group_advantages,
    nft_loss,
    nft_optimality,
)
from milepost.diffusion.sde import sample

torch.set_num_threads(1)


def test_group_advantages_skip_invalid_samples() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 99.0, 5.0, 5.0, 5.0, 5.0])
    valid = torch.tensor([True, True, True, False, True, False, False, False])
    adv = group_advantages(rewards, valid, group_size=4, clip=5.0)
    assert adv[3] == 0 and torch.all(adv[4:] == 0)  # invalid, and a group with one valid sample
    torch.testing.assert_close(adv[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-3, rtol=0)
    assert nft_optimality(torch.tensor([-3.0, 0.0, 0.5])).tolist() == [0.0, 0.5, 0.75]


def _model() -> TinyDiT:
    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(dim=16, depth=1, heads=2))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model


def test_flow_grpo_at_the_rollout_weights() -> None:
    model = _model()
    labels = torch.tensor([0, 0, 1, 1])
    traj = sample(model, labels, num_steps=4, guidance=2.0, noise_level=0.7, seed=3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, stats = flow_grpo_step_loss(
        model, _model(), x=traj.latents[:, 1], x_next=traj.latents[:, 2], t=traj.timesteps[1], t_next=traj.timesteps[2],
        t_max=float(traj.timesteps[1]), old_logp=traj.log_probs[:, 1], adv=adv, labels=labels, guidance=2.0,
        noise_level=0.7, eps_clip=1e-3, kl_coef=1.0, null_label=3)
    assert float(stats["logp_diff_abs"]) < 1e-5 and abs(float(stats["ratio"]) - 1) < 1e-5
    assert float(stats["kl"]) < 1e-10  # the reference is the same model
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_nft_at_r1_beta1_is_the_flow_matching_loss() -> None:
    model = _model()
    x0, noise = torch.randn(3, 3, 32, 32) * 0.3, torch.randn(3, 3, 32, 32)
    labels, t = torch.tensor([0, 1, 2]), torch.tensor([0.3, 0.5, 0.8])
    with torch.no_grad():
        v_old = model((1 - t.reshape(-1, 1, 1, 1)) * x0 + t.reshape(-1, 1, 1, 1) * noise, t, labels)
    loss, stats = nft_loss(model, x0=x0, labels=labels, t=t, noise=noise, v_old=v_old, r=torch.ones(3), beta=1.0)
    torch.testing.assert_close(loss, ((v_old - (noise - x0)) ** 2).mean())
    torch.testing.assert_close(stats["nft_pos_mse"], loss.detach())


def test_nft_kl_to_the_reference_pulls_toward_it() -> None:
    """--nft-kl-coef: zero where the policy is the reference; where it is not, the term is the
    squared velocity gap and its gradient moves the policy's velocity toward the reference's."""
    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(dim=16, depth=1, heads=2))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x0, noise, labels, t = torch.randn(3, 3, 32, 32), torch.randn(3, 3, 32, 32), torch.tensor([0, 1, 2]), torch.full((3,), 0.6)
    x_t = (1 - t.reshape(-1, 1, 1, 1)) * x0 + t.reshape(-1, 1, 1, 1) * noise  # as nft_loss forms it
    with torch.no_grad():
        v_same = model(x_t, t, labels)
    kw = {"x0": x0, "labels": labels, "t": t, "noise": noise, "v_old": v_same, "r": torch.full((3,), 0.5), "beta": 1.0}
    plain, _ = nft_loss(model, **kw)
    same, stats = nft_loss(model, **kw, v_ref=v_same, kl_coef=10.0)
    assert stats["kl"] == 0 and torch.equal(plain, same)
    v_ref = v_same + 0.1
    model.zero_grad()
    only_kl, stats = nft_loss(model, **kw, v_ref=v_ref, kl_coef=1e6)  # the KL dominates the gradient
    torch.testing.assert_close(stats["kl"], torch.tensor(0.01), rtol=1e-4, atol=0)
    only_kl.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-9 * p.grad
        gap_after = ((model(x_t, t, labels) - v_ref) ** 2).mean()
    assert gap_after < 0.01
