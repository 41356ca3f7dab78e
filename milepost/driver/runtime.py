"""Everything one trainer rank holds during a run, with one method per step of the loop.

Rank 0 talks to the engines (rollout, weight update) and owns the data source, metrics and
progress; every rank trains its share of each rollout. Groups travel from rank 0 to the others
as Python objects over the default process group. The sync driver (sync.py) calls these methods
in the order of the algorithm; this file is where their mechanics live.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from milepost.config import TrainConfig
from milepost.data.rollout_io import load_rollout, save_rollout
from milepost.data.source import PromptDataset
from milepost.observe.metrics import MetricsLogger
from milepost.observe.progress import StepProgress
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import SamplingSettings, rollout_groups, rollout_metrics
from milepost.rollout.rewards import load_group_reward_fn, load_reward_fn
from milepost.train.advantages import AdvantageSettings, get_estimator
from milepost.train.batch import TrainBatch, split_for_rank
from milepost.train.checkpoint import checkpoint_path, latest_checkpoint
from milepost.train.fsdp import FSDPBackend
from milepost.train.settings import TrainerSettings
from milepost.types import Group
from milepost.weights.sync import WeightSync
from milepost.weights.transport import BroadcastTransport, TensorTransport

log = logging.getLogger(__name__)

# Consecutive rollouts that yield no trainable group before the run stops (engines gone, say).
MAX_EMPTY_ROLLOUTS = 3


@dataclass
class StepTimer:
    times: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds


class Runtime:
    def __init__(self, cfg: TrainConfig, engine_urls: list[str], router_url: str | None) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.lead = self.rank == 0
        self.engine_urls = engine_urls
        self.step_metrics: dict[str, float] = {}
        self.timer = StepTimer()
        self._empty_rollouts = 0
        self.backend = None if cfg.rollout_only else FSDPBackend.create(
            cfg.hf_checkpoint, trainer_settings(cfg))
        self.start_step = 0
        self.data: PromptDataset | None = None
        self.weights: WeightSync | None = None
        if self.lead:
            self._init_lead()
        self._resume()
        self.metrics = MetricsLogger(cfg.run_dir, tensorboard=cfg.use_tensorboard,
                                     wandb=cfg.use_wandb, wandb_project=cfg.wandb_project,
                                     start_step=self.start_step) if self.lead else None
        self.progress = StepProgress(cfg.num_rollout, start=self.start_step) if self.lead else None

    def _init_lead(self) -> None:
        cfg = self.cfg
        from transformers import AutoTokenizer

        if cfg.load_rollouts is None:
            tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
            self.data = PromptDataset.from_file(
                cfg.prompt_data, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                metadata_key=cfg.metadata_key, apply_chat_template=cfg.apply_chat_template,
                shuffle=cfg.rollout_shuffle, seed=cfg.rollout_seed)
            self.reward_fn = load_reward_fn(cfg.reward_fn)
            self.group_reward_fn = (load_group_reward_fn(cfg.group_reward_fn)
                                    if cfg.group_reward_fn else None)
        if self.engine_urls and not cfg.rollout_only:
            transport = (TensorTransport(self.engine_urls)
                         if cfg.update_weight_transfer_mode == "tensor"
                         else BroadcastTransport(self.engine_urls,
                                                 "nccl" if cfg.device == "cuda" else "gloo"))
            self.weights = WeightSync(transport, cfg.update_weight_buffer_size,
                                      dtype=getattr(torch, cfg.dtype),
                                      check_weight_update=cfg.check_weight_update)
        else:
            self.weights = None

    def _resume(self) -> None:
        cfg = self.cfg
        if cfg.resume == "never" or self.backend is None:
            return
        path = latest_checkpoint(cfg.run_dir) if cfg.resume == "auto" else Path(cfg.resume)
        if path is None:
            return
        extra = self.backend.load_checkpoint(path)
        self.start_step = int(extra["step"]) + 1
        if self.data is not None and extra.get("data") is not None:
            self.data.load_state_dict(extra["data"])
        if self.lead:
            log.info("resumed from %s: continuing at step %d", path, self.start_step)

    # ---- the steps of the loop ---------------------------------------------------------------
    def steps(self) -> range:
        return range(self.start_step, self.cfg.num_rollout)

    def generate(self, step: int) -> list[Group]:
        """Rank 0 produces the step's groups (engines or saved rollouts); all ranks receive them."""
        t0 = time.perf_counter()
        groups: list[Group] | None = None
        if self.lead:
            groups = self._lead_rollout(step)
        box = [groups]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        self.timer.add("perf/rollout_time", time.perf_counter() - t0)
        return box[0]

    def _lead_rollout(self, step: int) -> list[Group]:
        cfg = self.cfg
        if cfg.load_rollouts is not None:
            return load_rollout(cfg.load_rollouts, step)
        want = cfg.rollout_batch_size
        groups: list[Group] = []
        while len(groups) < want:
            result = asyncio.run(self._rollout(self.data.next_batch(want - len(groups)), step))
            self.data.requeue(result.requeue)
            groups += result.groups
            self.step_metrics.update({f"rollout/{k}": v for k, v in rollout_metrics(result).items()})
            if not result.groups:
                self._empty_rollouts += 1
                if self._empty_rollouts >= MAX_EMPTY_ROLLOUTS:
                    raise RuntimeError(
                        f"{MAX_EMPTY_ROLLOUTS} rollouts in a row produced no trainable group "
                        f"(aborted: {result.num_aborted_groups}, failed: {len(result.dropped)}); "
                        "check the engine logs under logs/ and the reward function")
            else:
                self._empty_rollouts = 0
        rewards = torch.tensor([s.reward for g in groups for s in g], dtype=torch.float64)
        self.step_metrics["rollout/reward_mean"] = rewards.mean().item()
        self.step_metrics["rollout/reward_std"] = rewards.std(correction=0).item()
        if cfg.save_rollouts is not None:
            save_rollout(cfg.save_rollouts, step, groups)
        return groups

    async def _rollout(self, items: list, step: int):
        cfg = self.cfg
        sampling = SamplingSettings(
            temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p, top_k=cfg.rollout_top_k,
            max_new_tokens=cfg.rollout_max_response_len, stop=tuple(cfg.rollout_stop or ()),
            stop_token_ids=tuple(cfg.rollout_stop_token_ids or ()))
        clients = [EngineClient(url) for url in self.engine_urls]
        try:
            return await rollout_groups(
                clients, items, cfg.n_samples_per_prompt, sampling, self.reward_fn,
                self.group_reward_fn, cfg.rollout_max_concurrency,
                group_index_start=step * cfg.rollout_batch_size)
        finally:
            for c in clients:
                await c.aclose()

    def train(self, groups: list[Group]) -> None:
        if self.backend is None:
            return
        t0 = time.perf_counter()
        samples = [s for g in groups for s in g]
        estimator = get_estimator(self.cfg.advantage_estimator)
        advantages = estimator(samples, AdvantageSettings(normalize_std=self.cfg.normalize_advantages))
        mine = split_for_rank(samples, self.rank, self.world, self.cfg.global_batch_size)
        batch = TrainBatch.from_samples([samples[i] for i in mine], [advantages[i] for i in mine])
        if self.cfg.use_rollout_logprobs:
            batch.old_logprobs = batch.rollout_logprobs
        metrics = self.backend.train_step(batch)
        self.step_metrics.update({f"train/{k}": v for k, v in metrics.items()})
        self.timer.add("perf/train_time", time.perf_counter() - t0)

    def save_due(self, step: int) -> bool:
        cfg = self.cfg
        last = step == cfg.num_rollout - 1
        return self.backend is not None and (last or (cfg.save_interval > 0
                                                      and (step + 1) % cfg.save_interval == 0))

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        extra = {"step": step, "data": self.data.state_dict() if self.data is not None else None}
        box = [extra]
        if self.world > 1:  # the data state lives on rank 0; every rank writes the same extra
            dist.broadcast_object_list(box, src=0)
        self.backend.save_checkpoint(checkpoint_path(self.cfg.run_dir, step), box[0])
        if step == self.cfg.num_rollout - 1 and self.cfg.save_hf_at_end:
            self.backend.export_hf(Path(self.cfg.run_dir) / "hf")
        self.timer.add("perf/save_time", time.perf_counter() - t0)

    def offload_trainer(self) -> None:
        if self.backend is not None:
            self.backend.offload()

    def onload_trainer(self) -> None:
        if self.backend is not None:
            self.backend.onload()

    def push_resumed_weights(self) -> None:
        """After a resume the engines still hold the initial weights: send the trained ones."""
        if self.start_step > 0:
            self.update_weights(self.start_step - 1, force=True)

    def update_weights(self, step: int, force: bool = False) -> None:
        """Every rank gathers (a collective); rank 0 sends. Engines then report version step+1."""
        if self.backend is None or not self.engine_urls:
            return
        if not force and (step + 1) % self.cfg.update_weights_interval:
            return
        t0 = time.perf_counter()
        named = self.backend.named_hf_weights()
        if self.weights is not None:
            stats = self.weights.update(named, str(step + 1))
            self.step_metrics["perf/update_weights_bytes"] = stats.bytes
        else:
            for _ in named:  # take part in the gathers
                pass
        self.timer.add("perf/update_weights_time", time.perf_counter() - t0)

    def log(self, step: int, step_start: float) -> None:
        self.timer.add("perf/step_time", time.perf_counter() - step_start)
        if self.lead:
            merged = {**self.step_metrics, **self.timer.times}
            if step % self.cfg.log_interval == 0 or step == self.cfg.num_rollout - 1:
                self.metrics.log(step, merged)
            self.progress.update(step, merged)
        self.step_metrics = {}
        self.timer = StepTimer()

    def close(self) -> None:
        if self.lead:
            self.metrics.close()
            self.progress.close()
            if self.weights is not None:
                self.weights.close()


def trainer_settings(cfg: TrainConfig) -> TrainerSettings:
    """The run config's trainer fields, one to one."""
    return TrainerSettings(
        lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_iters=cfg.lr_warmup_iters,
        lr_decay_style=cfg.lr_decay_style,
        num_steps_total=cfg.num_rollout * cfg.optimizer_steps_per_rollout,
        weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad, global_batch_size=cfg.global_batch_size,
        max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch, eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high, use_kl_loss=cfg.use_kl_loss,
        kl_loss_coef=cfg.kl_loss_coef, kl_loss_type=cfg.kl_loss_type,
        entropy_coef=cfg.entropy_coef, temperature=cfg.rollout_temperature, seed=cfg.seed,
        dtype=cfg.dtype, device=cfg.device,
    )
