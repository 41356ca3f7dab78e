"""The diffusion RL loop: rollout (engine over HTTP) -> rewards -> train step -> weights back.

`milepost train RECIPE.toml` with a `[diffusion]` table runs `run(cfg)`. The engine is a child
process (`python -m milepost.diffusion.server`) on a loopback port; metrics go to
run_dir/metrics.jsonl, image grids of the first and last steps to run_dir/grids/.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from milepost.diffusion.client import GroupResult, collect, final_images
from milepost.diffusion.config import DiffusionConfig
from milepost.diffusion.grid import save_grid
from milepost.diffusion.objectives import group_advantages
from milepost.diffusion.quality import probe_accuracy
from milepost.diffusion.rewards import checked_rewards, make_reward
from milepost.diffusion.trainer import DiffusionTrainer, RolloutBatch
from milepost.diffusion.weights import push_weights
from milepost.launch.process import ManagedProcess, free_port
from milepost.observe.metrics import MetricsLogger
from milepost.weights.transport import BroadcastTransport

log = logging.getLogger(__name__)


def start_engine(cfg: DiffusionConfig) -> tuple[ManagedProcess, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "milepost.diffusion.server", "--model-path", str(cfg.diffusion_checkpoint),
           "--port", str(port), "--device", cfg.device, "--attention-backend", cfg.attention_backend,
           "--num-threads", str(torch.get_num_threads())]
    if cfg.deterministic:
        cmd.append("--deterministic")
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess("diffusion-engine", cmd, cfg.run_dir / "engine.log", f"{url}/health",
                          timeout_s=300.0, tied_to_parent=True, wait=False)  # run() waits once its trainer is built
    return proc, url


def _batch(results: list[GroupResult], cfg: DiffusionConfig) -> RolloutBatch:
    rewards = torch.from_numpy(np.concatenate([r.rewards for r in results]))
    valid = torch.from_numpy(np.concatenate([r.valid for r in results]))
    adv = group_advantages(rewards, valid, cfg.n_samples_per_prompt, cfg.adv_clip_max)
    return RolloutBatch(
        latents=torch.from_numpy(np.concatenate([r.latents for r in results])).float(),
        log_probs=torch.from_numpy(np.concatenate([r.log_probs for r in results])).float(),
        timesteps=torch.from_numpy(np.array(results[0].timesteps)).float(),
        labels=torch.from_numpy(np.concatenate([r.labels for r in results])).long(), adv=adv, valid=valid)


def run(cfg: DiffusionConfig) -> int:
    """Train; 0 on success."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the step lines
    reward_fn = make_reward(cfg.reward_fn, brightness_target=cfg.brightness_target, classifier_path=cfg.classifier_path)
    classifier = None
    if cfg.classifier_path is not None:
        from milepost.diffusion.classifier import load_classifier

        classifier = load_classifier(cfg.classifier_path)
    engine, url = start_engine(cfg)  # it loads its model while this process loads the trainer's
    try:
        trainer = DiffusionTrainer(cfg)
        engine.wait_ready()
    except BaseException:
        engine.close()
        raise
    image = (trainer.base_config().channels, trainer.base_config().image_size, trainer.base_config().image_size)
    n_classes = trainer.base_config().num_classes
    params = {"num_steps": cfg.num_denoising_steps, "guidance_scale": cfg.guidance_scale,
              "noise_level": cfg.noise_level, "time_shift": cfg.time_shift}

    def score(images: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return checked_rewards(reward_fn, images, labels, cfg.reward_fn)

    # bodies are unpacked off the event loop in either format (a JSON parse holds the GIL for seconds)
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    transport = BroadcastTransport([url], "gloo") if cfg.weight_transport == "broadcast" else None

    def probe() -> float:  # the classifier's accuracy on the fixed probe batch with the engine's weights now
        return probe_accuracy(url, classifier, size=cfg.quality_probe, n_classes=n_classes, params=params,
                              fmt=cfg.transfer_format, image=image, seed=cfg.seed)

    try:
        with engine, MetricsLogger(cfg.run_dir) as metrics:
            base_probe = probe() if cfg.quality_probe and classifier is not None else None
            for step in range(cfg.num_rollout):
                rng = np.random.default_rng([cfg.seed, step])
                groups = [(int(rng.integers(n_classes)), cfg.n_samples_per_prompt) for _ in range(cfg.rollout_batch_size)]
                seeds = [int(s) for s in rng.integers(0, 2**31 - 1, size=len(groups))]
                results, times = asyncio.run(collect(url, groups, seeds=seeds, params=params, fmt=cfg.transfer_format,
                                                     image=image, score=score, pool=pool))
                batch = _batch(results, cfg)
                t = time.perf_counter()
                train = trainer.train_step(batch, step)
                train_s = time.perf_counter() - t
                t = time.perf_counter()
                push_weights(trainer, url, cfg, version=str(step + 1), transport=transport)
                update_s = time.perf_counter() - t
                images = torch.from_numpy(np.concatenate([final_images(r) for r in results])).float()
                row = {**train, **_rollout_metrics(batch, results, classifier, images),
                       "perf/rollout_s": times.wall_s, "perf/decode_s": times.decode_s, "perf/reward_s": times.reward_s,
                       "perf/train_s": train_s, "perf/weight_update_s": update_s, "perf/body_bytes": float(times.body_bytes),
                       "perf/images_per_s": len(images) / max(times.wall_s, 1e-9)}
                if base_probe is not None:
                    if step == 0:
                        row["quality/base_probe_accuracy"] = base_probe
                    if (step + 1) % cfg.quality_every == 0 or step == cfg.num_rollout - 1:
                        row["quality/probe_accuracy"] = probe()
                        row["quality/probe_drop"] = base_probe - row["quality/probe_accuracy"]
                metrics.log(step, row)
                log.info("step %d/%d reward %.4f classifier_acc %s", step + 1, cfg.num_rollout,
                         row["rollout/reward_mean"], row.get("quality/classifier_accuracy"))
                if cfg.save_grids and step in (0, cfg.num_rollout - 1):
                    save_grid(images, cfg.run_dir / "grids" / ("before.png" if step == 0 else "after.png"))
    finally:
        if transport is not None:
            transport.close()
        pool.shutdown(cancel_futures=True)
    return 0


def _rollout_metrics(batch: RolloutBatch, results: list[GroupResult], classifier: object | None,
                     images: torch.Tensor) -> dict[str, float]:
    rewards = torch.from_numpy(np.concatenate([r.rewards for r in results]))
    valid = batch.valid
    out = {"rollout/reward_mean": float(rewards[valid].mean()) if valid.any() else float("nan"),
           "rollout/reward_std": float(rewards[valid].std()) if valid.sum() > 1 else 0.0,
           "rollout/bad_rewards": float((~valid).sum()),
           "rollout/log_prob_mean": float(batch.log_probs.mean()),
           "rollout/weight_version": float(results[0].weight_version)}
    if classifier is not None:
        with torch.no_grad():
            pred = classifier(images).argmax(-1)  # type: ignore[operator]
        out["quality/classifier_accuracy"] = float((pred == batch.labels).float().mean())
    return out
