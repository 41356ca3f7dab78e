"""The diffusion trainer: one optimizer step per rollout batch under the run's objective.

Holds the policy (full fine-tune, or LoRA on a frozen base), the frozen reference for the KL,
and Adam. `train_step` re-scores the recorded steps `diffusion_train_timesteps` (Flow-GRPO), fits
the rollout's clean images (DiffusionNFT) or data images (SFT), and returns metrics;
`engine_weights` is what goes to the engine (all weights, or only the adapters to merge).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import numpy as np
import torch

from milepost.diffusion import lora
from milepost.diffusion.base_model import flow_matching_loss
from milepost.diffusion.config import DiffusionConfig
from milepost.diffusion.model import TinyDiT, load_model
from milepost.diffusion.objectives import flow_grpo_step_loss, nft_loss, nft_optimality
from milepost.diffusion.precision import apply_precision


@dataclass
class RolloutBatch:
    """One step's trajectories. latents [B,S+1,C,H,W], log_probs [B,S], timesteps [S+1],
    labels [B], adv [B] (0 where the reward was invalid), valid [B]."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    timesteps: torch.Tensor
    labels: torch.Tensor
    adv: torch.Tensor
    valid: torch.Tensor


class DiffusionTrainer:
    def __init__(self, cfg: DiffusionConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model: TinyDiT = load_model(cfg.diffusion_checkpoint, self.device)
        self.model.set_attention(cfg.attention_backend)
        self.ref: TinyDiT | None = None
        if (cfg.kl_loss_coef > 0 and cfg.diffusion_objective == "flow_grpo") or \
                (cfg.nft_kl_coef > 0 and cfg.diffusion_objective == "nft"):
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        if cfg.lora_rank:
            lora.attach_lora(self.model, cfg.lora_rank, cfg.lora_alpha)
        self.model = apply_precision(self.model, cfg)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                     weight_decay=cfg.weight_decay)
        self.sft_data: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.diffusion_objective == "sft":
            data = np.load(cfg.sft_data)  # type: ignore[arg-type]
            self.sft_data = torch.from_numpy(data["images"]).float(), torch.from_numpy(data["labels"]).long()

    def _steps(self, num_steps: int) -> list[int]:
        """Step indices to train at; by default every stochastic step (the last is deterministic)."""
        return list(self.cfg.diffusion_train_timesteps or range(max(num_steps - 1, 1)))

    def train_step(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """One optimizer step (per inner epoch) on `batch`; metrics averaged over its parts."""
        cfg, model = self.cfg, self.model
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        keep = batch.valid.nonzero().reshape(-1)
        if cfg.diffusion_objective != "sft" and len(keep) == 0:
            return {"train/skipped": 1.0}
        stats: dict[str, list[float]] = {}
        times = {"perf/rescore_s": 0.0, "perf/optimizer_s": 0.0}  # forward + backward vs clip + Adam
        model.train()
        for _ in range(cfg.inner_epochs):
            t0 = self._clock()
            self.opt.zero_grad(set_to_none=True)
            if cfg.diffusion_objective == "flow_grpo":
                parts = self._flow_grpo(batch, keep)
            elif cfg.diffusion_objective == "nft":
                parts = self._nft(batch, keep, gen)
            else:
                parts = self._sft(len(batch.labels), gen)
            t1 = self._clock()
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], cfg.clip_grad)
            self.opt.step()
            times["perf/optimizer_s"] += self._clock() - t1
            times["perf/rescore_s"] += t1 - t0
            parts.append({"grad_norm": grad_norm.detach()})
            for part in parts:
                for k, v in part.items():
                    stats.setdefault(f"train/{k}", []).append(float(v))
        model.eval()
        return {**{k: float(np.mean(v)) for k, v in stats.items()}, **times}

    def _clock(self) -> float:
        """perf_counter after the device's queued work (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _flow_grpo(self, batch: RolloutBatch, keep: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        cfg, dev = self.cfg, self.device
        steps = self._steps(batch.log_probs.shape[1])
        grid = batch.timesteps.to(dev)
        t_max = float(grid[1]) if len(grid) > 2 else 0.5
        labels, adv = batch.labels[keep].to(dev), batch.adv[keep].to(dev)
        parts = []
        for j in steps:  # one backward per step: memory of one step's activations
            loss, part = flow_grpo_step_loss(
                self.model, self.ref, x=batch.latents[keep, j].to(dev), x_next=batch.latents[keep, j + 1].to(dev),
                t=grid[j], t_next=grid[j + 1], t_max=t_max, old_logp=batch.log_probs[keep, j].to(dev), adv=adv,
                labels=labels, guidance=cfg.guidance_scale, noise_level=cfg.noise_level, eps_clip=cfg.eps_clip,
                kl_coef=cfg.kl_loss_coef, null_label=self.model_config_classes())
            (loss / len(steps)).backward()
            parts.append({**part, "loss": loss.detach()})
        return parts

    def _nft(self, batch: RolloutBatch, keep: torch.Tensor, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
        cfg, dev = self.cfg, self.device
        x0 = batch.latents[keep, -1].to(dev)
        labels, r = batch.labels[keep].to(dev), nft_optimality(batch.adv[keep].to(dev))
        grid = batch.timesteps
        parts = []
        steps = self._steps(batch.log_probs.shape[1])
        for j in steps:  # the grid's times at the chosen steps (t_j of step j), fresh noise each
            t = grid[j].clamp(max=0.999).expand(len(keep)).to(dev)
            noise = torch.randn(x0.shape, generator=gen).to(dev)
            with torch.no_grad():
                tt = t.reshape(-1, 1, 1, 1)
                x_t = (1 - tt) * x0 + tt * noise
                v_old = self.model(x_t, t, labels)
                v_ref = self.ref(x_t, t, labels) if self.ref is not None else None
            loss, part = nft_loss(self.model, x0=x0, labels=labels, t=t, noise=noise, v_old=v_old, r=r, beta=cfg.nft_beta,
                                  v_ref=v_ref, kl_coef=cfg.nft_kl_coef)
            (loss / len(steps)).backward()
            parts.append({**part, "loss": loss.detach()})
        return parts

    def _sft(self, n: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
        assert self.sft_data is not None
        images, labels = self.sft_data
        with torch.no_grad():  # the same 64 images, times and noise every step: a loss that can trend
            k = min(64, len(images))
            held = flow_matching_loss(self.model, images[:k].to(self.device), labels[:k].to(self.device),
                                      torch.Generator().manual_seed(0))
        idx = torch.randint(0, len(images), (n,), generator=gen)
        loss = flow_matching_loss(self.model, images[idx].to(self.device), labels[idx].to(self.device), gen)
        loss.backward()
        return [{"loss": loss.detach(), "sft_loss": loss.detach(), "sft_fixed_batch_loss": held}]

    def model_config_classes(self) -> int:
        return self.base_config().num_classes

    def base_config(self):
        return getattr(self.model, "config", None) or self.model.module.config  # type: ignore[union-attr]

    def engine_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What the engine gets: the adapters (merged there) with LoRA, else every weight (FP32)."""
        if self.cfg.lora_rank:
            return lora.adapter_tensors(self.model)
        return [(k, v.detach().float().cpu()) for k, v in full_state(self.model).items()]

    def expected_engine_state(self) -> dict[str, torch.Tensor]:
        """The engine's state once it applied `engine_weights` (to check its checksums)."""
        if self.cfg.lora_rank:
            return {k: v.cpu() for k, v in lora.merged_state(self.model).items()}
        return {k: v.detach().float().cpu() for k, v in full_state(self.model).items()}


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) state dict, FSDP2 or not."""
    from milepost.diffusion.precision import gathered_state

    return gathered_state(model)
