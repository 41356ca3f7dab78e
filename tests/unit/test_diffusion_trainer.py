"""The diffusion trainer never trains on samples whose reward was bad (issue 29, "Bad input"):
samples marked invalid (a NaN or wrong-shaped reward, milepost/diffusion/rewards.py) are left out of
the Flow-GRPO and DiffusionNFT steps, whatever their trajectories hold, and a batch with no valid
sample is skipped without touching the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.diffusion.config import DiffusionConfig
from milepost.diffusion.model import DiTConfig, TinyDiT, save_model
from milepost.diffusion.objectives import group_advantages
from milepost.diffusion.sde import sample
from milepost.diffusion.trainer import DiffusionTrainer, RolloutBatch

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(dim=16, depth=1, heads=2))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return save_model(model, tmp_path_factory.mktemp("dit") / "dit")


def _trainer(model_dir: Path, tmp_path: Path, objective: str) -> DiffusionTrainer:
    cfg = DiffusionConfig(diffusion_checkpoint=model_dir, device="cpu", run_dir=tmp_path, num_denoising_steps=4,
                          guidance_scale=2.0, diffusion_objective=objective, kl_loss_coef=0.01, nft_kl_coef=0.1, lr=1e-2)
    return DiffusionTrainer(cfg)


def _batch(trainer: DiffusionTrainer, valid: list[bool]) -> RolloutBatch:
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    traj = sample(trainer.model, labels, num_steps=4, guidance=2.0, noise_level=0.7, seed=5)
    rewards = traj.latents[:, -1].mean(dim=(1, 2, 3)).double()
    mask = torch.tensor(valid)
    return RolloutBatch(traj.latents, traj.log_probs, traj.timesteps, labels, group_advantages(rewards, mask, 4, 5.0), mask)


def _weights(trainer: DiffusionTrainer) -> torch.Tensor:
    return torch.cat([v.flatten() for _, v in trainer.engine_weights()])


@pytest.mark.parametrize("objective", ["flow_grpo", "nft"])
def test_invalid_samples_are_not_trained_on(model_dir: Path, tmp_path: Path, objective: str) -> None:
    valid = [True, True, False, True, True, True, True, False]
    a, b = _trainer(model_dir, tmp_path / "a", objective), _trainer(model_dir, tmp_path / "b", objective)
    batch = _batch(a, valid)
    poisoned = _batch(b, valid)
    bad = ~poisoned.valid
    poisoned.latents[bad] = float("nan")  # what an invalid sample holds must not matter
    poisoned.log_probs[bad] = float("nan")
    metrics_a, metrics_b = a.train_step(batch, step=0), b.train_step(poisoned, step=0)
    assert metrics_a == {**metrics_b, **{k: metrics_a[k] for k in metrics_a if k.startswith("perf/")}}
    assert metrics_a["train/grad_norm"] > 0
    before, after = _weights(_trainer(model_dir, tmp_path / "c", objective)), _weights(b)
    assert torch.isfinite(after).all() and torch.equal(_weights(a), after) and not torch.equal(before, after)


@pytest.mark.parametrize("objective", ["flow_grpo", "nft"])
def test_a_batch_without_valid_samples_is_skipped(model_dir: Path, tmp_path: Path, objective: str) -> None:
    trainer = _trainer(model_dir, tmp_path, objective)
    before = _weights(trainer)
    batch = _batch(trainer, [False] * 8)
    assert torch.all(batch.adv == 0)
    assert trainer.train_step(batch, step=0) == {"train/skipped": 1.0}
    assert torch.equal(_weights(trainer), before)
