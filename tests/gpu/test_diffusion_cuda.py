"""Diffusion on CUDA (issue 29): SDE sampling with CFG, a Flow-GRPO train step with per-module
dtypes through FSDP2 (BF16 blocks, FP32 timestep embedder and modulation tables), deterministic
mode repeating a train step bit for bit, and trajectories as raw bytes vs JSON with timings.

Run on the accelerator machine: `python -m pytest -q -s -m gpu tests/gpu/test_diffusion_cuda.py`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from milepost.diffusion.codec import from_json, pack, to_json, unpack
from milepost.diffusion.config import DiffusionConfig
from milepost.diffusion.model import DiTConfig, TinyDiT, save_model
from milepost.diffusion.objectives import group_advantages
from milepost.diffusion.sde import sample
from milepost.diffusion.trainer import DiffusionTrainer, RolloutBatch

# cuBLAS reads this when it creates its handle: set before any CUDA work for the deterministic test
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(dim=128, depth=4, heads=4))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return save_model(model, tmp_path / "dit")


def _batch(trainer: DiffusionTrainer, n: int = 16, steps: int = 8) -> RolloutBatch:
    labels = torch.arange(n, device="cuda") // 4 % 3
    traj = sample(trainer.model, labels, num_steps=steps, guidance=2.0, noise_level=0.7, seed=1)
    rewards = traj.latents[:, -1].mean(dim=(1, 2, 3)).double()
    valid = torch.ones(n, dtype=torch.bool)
    return RolloutBatch(traj.latents, traj.log_probs, traj.timesteps, labels.cpu(),
                        group_advantages(rewards, valid, 4, 5.0), valid)


def _train_once(model_dir: Path, run_dir: Path, **kw: object) -> tuple[dict[str, float], torch.Tensor]:
    cfg = DiffusionConfig(diffusion_checkpoint=model_dir, device="cuda", run_dir=run_dir, guidance_scale=2.0,
                          num_denoising_steps=8, **kw)  # type: ignore[arg-type]
    trainer = DiffusionTrainer(cfg)
    metrics = trainer.train_step(_batch(trainer), step=0)
    return metrics, torch.cat([v.flatten().float().cpu() for _, v in trainer.engine_weights()])


def test_sampling_throughput_and_formats(tmp_path: Path) -> None:
    from milepost.diffusion.model import load_model

    model = load_model(_model_dir(tmp_path), "cuda").eval()
    labels = torch.arange(256, device="cuda") % 3
    sample(model, labels[:8], num_steps=2, guidance=2.0, noise_level=0.7, seed=0)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    traj = sample(model, labels, num_steps=20, guidance=2.0, noise_level=0.7, seed=0)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    arrays = {"latents": traj.latents.numpy(), "log_probs": traj.log_probs.numpy()}
    t = time.perf_counter()
    raw = pack({}, arrays)
    unpack(raw)
    raw_s = time.perf_counter() - t
    t = time.perf_counter()
    js = to_json({}, arrays)
    from_json(js)
    json_s = time.perf_counter() - t
    print(f"\nrollout: {256 / secs:.1f} images/s (256 images, 20 steps, CFG 2); trajectory "
          f"{len(raw) / 1e6:.1f} MB raw in {raw_s:.3f} s vs {len(js) / 1e6:.1f} MB JSON in {json_s:.3f} s (pack+unpack)")
    assert torch.isfinite(traj.log_probs).all() and raw_s < json_s


def test_fsdp2_mixed_precision_flow_grpo_step(tmp_path: Path) -> None:
    metrics, _ = _train_once(_model_dir(tmp_path), tmp_path / "run", trainer_backend="fsdp2", param_dtype="bfloat16")
    assert metrics["train/grad_norm"] > 0 and abs(metrics["train/ratio"] - 1) < 0.05


def test_deterministic_step_repeats_bit_for_bit(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path)
    a = _train_once(model_dir, tmp_path / "a", deterministic=True)
    b = _train_once(model_dir, tmp_path / "b", deterministic=True)
    assert a[0] == b[0] and torch.equal(a[1], b[1])
