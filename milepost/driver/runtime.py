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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from milepost.config import TrainConfig
from milepost.data.rollout_io import load_rollout, save_rollout
from milepost.data.source import PromptDataset, PromptItem
from milepost.driver.objective import rank_batch
from milepost.driver.preflight import (
    RunError,
    check_resume,
    load_reward_fns,
    lora_fingerprint,
    model_fingerprint,
    resume_checkpoint,
)
from milepost.driver.engine_health import wait_for_engines
from milepost.driver.sampling_settings import eval_sampling, rollout_sampling
from milepost.driver.trainer_settings import trainer_settings
from milepost.eval.shared import evaluate_on_engines
from milepost.lora.engines import load_policy_adapter
from milepost.lora.multi_data import (
    AdapterPrompts,
    AdapterRewards,
    adapter_eval_items,
    adapter_metrics,
    adapter_specs,
)
from milepost.lora.settings import POLICY_ADAPTER
from milepost.observe.metrics import MetricsLogger
from milepost.observe.progress import StepProgress
from milepost.rollout.agentic import (
    AgenticRollout,
    pad_to_optimizer_steps,
    rollout_layers_enabled,
)
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import (
    RolloutResult,
    SamplingSettings,
    rollout_groups,
    rollout_metrics,
)
from milepost.rollout.teacher import ServedTeachers, TeacherError, teachers_of_run
from milepost.train.backend import create_backend
from milepost.train.checkpoint import checkpoint_path
from milepost.train.megatron.preflight import sizes_of as megatron_sizes
from milepost.types import Group
from milepost.weights.factory import make_weight_sync
from milepost.weights.sync import WeightSync

log = logging.getLogger(__name__)

T = TypeVar("T")

# Consecutive rollouts that yield no trainable group before the run stops (engines gone, say).
MAX_EMPTY_ROLLOUTS = 3


@dataclass
class StepTimer:
    times: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds


def _merge(into: RolloutResult, more: RolloutResult) -> None:
    into.groups += more.groups
    into.requeue += more.requeue
    into.dropped += more.dropped
    into.aborted_groups += more.aborted_groups
    into.failed_groups += more.failed_groups
    into.num_reward_errors += more.num_reward_errors
    into.num_engine_refusals += more.num_engine_refusals
    into.num_teacher_failures += more.num_teacher_failures
    into.elapsed_s += more.elapsed_s


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
        self.start_step = 0
        self.data: PromptDataset | None = None
        self.weights: WeightSync | None = None
        self.teachers: ServedTeachers | None = None  # on-policy distillation, rank 0
        self.adapter_eval_items: dict[str, list[PromptItem]] = {}  # multi-LoRA: eval/<adapter>/...
        if self.lead:  # first: a bad dataset row stops the run before the model is sharded
            self._init_lead()
        elif engine_urls and not cfg.rollout_only:  # p2p: every trainer rank sends (report 4.2)
            self.weights = make_weight_sync(cfg, engine_urls, self.rank, self.world)
        # Plug-in rollout layers / session server (issue 6): replace the default rollout when set.
        self.agentic = (AgenticRollout(cfg, engine_urls, router_url, self._sampling())
                        if self.lead and rollout_layers_enabled(cfg) else None)
        self.backend = None if cfg.rollout_only else create_backend(
            cfg.hf_checkpoint, trainer_settings(cfg), cfg.train_backend, megatron_sizes(cfg))
        self._resume()
        if self.lead and self.engine_urls:
            wait_for_engines(self.engine_urls)
        if cfg.lora_rank and self.backend is not None and self.engine_urls:  # LoRA RL (docs/lora.md)
            load_policy_adapter(self.backend, self.engine_urls, Path(cfg.run_dir) / "lora_initial",
                                self.lead, adapters=[a["name"] for a in cfg.adapters or []])
        self.metrics = MetricsLogger(cfg.run_dir, tensorboard=cfg.use_tensorboard,
                                     wandb=cfg.use_wandb, wandb_project=cfg.wandb_project,
                                     start_step=self.start_step) if self.lead else None
        # Entered: on a terminal it is a live bar, which must be started before its first update.
        self.progress = (StepProgress(cfg.num_rollout, start=self.start_step).__enter__()
                         if self.lead else None)

    def _init_lead(self) -> None:
        cfg = self.cfg
        from transformers import AutoTokenizer

        if cfg.load_rollouts is None:
            tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
            keys = dict(input_key=cfg.input_key, label_key=cfg.label_key, metadata_key=cfg.metadata_key,
                        apply_chat_template=cfg.apply_chat_template, shuffle=cfg.rollout_shuffle)
            if cfg.adapters:  # multi-LoRA: each adapter's own prompts and reward (docs/lora.md)
                specs = adapter_specs(cfg.adapters, cfg.reward_fn, cfg.lr)
                self.data = AdapterPrompts.from_files(specs, tokenizer, cfg.rollout_seed, **keys)
                self.reward_fn = AdapterRewards({a.name: load_reward_fns(cfg.model_copy(
                    update={"reward_fn": a.reward_fn}))[0] for a in specs})
                self.group_reward_fn = None
                self.adapter_eval_items = adapter_eval_items(specs, tokenizer, **{
                    k: v for k, v in keys.items() if k != "shuffle"})
            else:
                self.data = PromptDataset.from_file(cfg.prompt_data, tokenizer, seed=cfg.rollout_seed, **keys)
                self.reward_fn, self.group_reward_fn = load_reward_fns(cfg)
            self.eval_items = (PromptDataset.from_file(
                cfg.eval_prompt_data, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                metadata_key=cfg.metadata_key, apply_chat_template=cfg.apply_chat_template,
                shuffle=False).items if cfg.eval_prompt_data is not None else [])
            try:  # checked by preflight too; again here for ranks started elsewhere
                self.teachers = teachers_of_run(cfg, tokenizer, self.data.items)
            except TeacherError as e:
                raise RunError(str(e)) from None
        if self.engine_urls and not cfg.rollout_only:
            self.weights = make_weight_sync(cfg, self.engine_urls, 0, self.world)
        else:
            self.weights = None

    def _resume(self) -> None:
        cfg = self.cfg
        if self.backend is None:
            return
        path = resume_checkpoint(cfg)
        if path is None:
            return
        check_resume(cfg, path)  # also done by the launcher; here for ranks started elsewhere
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
        return self._groups_from_lead(lambda: self._lead_rollout(step), "perf/rollout_time")

    def _groups_from_lead(self, produce: Callable[[], list[Group]], timer: str) -> list[Group]:
        """Rank 0 calls `produce`; every rank gets its groups. The wait counts under `timer`."""
        t0 = time.perf_counter()
        box = [produce() if self.lead else None]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        self.timer.add(timer, time.perf_counter() - t0)
        return box[0]

    def _lead_rollout(self, step: int) -> list[Group]:
        cfg = self.cfg
        if cfg.load_rollouts is not None:
            groups = load_rollout(cfg.load_rollouts, step)
            # The saved groups' own numbers (rewards, lengths, cache hits), as the saving run logged.
            replay = rollout_metrics(RolloutResult(groups=groups))
            self.step_metrics.update({f"rollout/{k}": v for k, v in replay.items()
                                      if k not in ("elapsed_s", "tokens_per_s")})
            return groups
        want = cfg.rollout_batch_size
        # Prompts whose groups were dropped (reward errors, refusals) or aborted are replaced by
        # further rollouts until the step has `want` groups; the step's metrics count them all.
        step_result = RolloutResult()
        attempted = 0
        while len(step_result.groups) < want:
            items = self.data.next_batch(want - len(step_result.groups))
            # Group indices stay unique within the step: GRPO normalizes rewards per group_index.
            result = asyncio.run(self._rollout(items, step * want + attempted))
            attempted += len(items)
            self.data.requeue(result.requeue)
            _merge(step_result, result)
            if not result.groups:
                self._empty_rollouts += 1
                if self._empty_rollouts >= MAX_EMPTY_ROLLOUTS:
                    raise RunError(
                        f"{MAX_EMPTY_ROLLOUTS} rollouts in a row produced no trainable group "
                        f"(aborted: {result.num_aborted_groups}, failed: {len(result.dropped)}, "
                        f"teacher failures: {result.num_teacher_failures}) "
                        f"from engines {self.engine_urls}; check the engine logs under "
                        f"{cfg.run_dir / 'logs'} and the reward function")
            else:
                self._empty_rollouts = 0
        self.step_metrics.update({f"rollout/{k}": v for k, v in rollout_metrics(step_result).items()})
        if cfg.adapters:  # rollout/<adapter>/reward_mean, ...
            names = [a["name"] for a in cfg.adapters]
            self.step_metrics.update({f"rollout/{k}": v for k, v in adapter_metrics(step_result.groups, names).items()})
        if self.teachers is not None:
            self.step_metrics.update({f"opd/{k}": v for k, v in self.teachers.take_metrics().items()})
        if cfg.save_rollouts is not None:
            save_rollout(cfg.save_rollouts, step, step_result.groups)
        return step_result.groups

    def _sampling(self) -> SamplingSettings:
        return rollout_sampling(self.cfg, self.cfg.seed if self.cfg.deterministic else None)

    async def _rollout(self, items: list, group_index_start: int) -> RolloutResult:
        cfg = self.cfg
        sampling = self._sampling()
        if self.agentic is not None:
            return await self.agentic.rollout(items, group_index_start, self.reward_fn,
                                              self.group_reward_fn)
        return await self._with_clients(lambda clients: rollout_groups(
            clients, items, cfg.n_samples_per_prompt, sampling, self.reward_fn,
            self.group_reward_fn, cfg.rollout_max_concurrency,
            group_index_start=group_index_start,
            return_routed_experts=cfg.use_rollout_routing_replay,
            finish_group=None if self.teachers is None else self.teachers.score_group,
            top_logprobs_num=cfg.opd_top_k))

    def train(self, groups: list[Group]) -> None:
        if self.backend is None:
            return
        t0 = time.perf_counter()
        samples = [s for g in groups for s in g]
        if self.cfg.session_leaf_selection != "latest":  # several sequences per session (issue 6)
            padded = pad_to_optimizer_steps(samples, int(self.cfg.global_batch_size))
            self.step_metrics["train/padding_samples"] = len(padded) - len(samples)
            samples = padded
        # Megatron: ranks of one model-parallel group train on the same samples
        data_rank, data_world = (getattr(self.backend, "data_rank", self.rank),
                                 getattr(self.backend, "data_world", self.world))
        batch = rank_batch(self.cfg, self.backend, samples, data_rank, data_world, self.step_metrics)
        metrics = self.backend.train_step(batch)
        turns = self.backend.take_turn_stats()  # --offload-actor-for-critic: the models took turns
        if turns is not None:
            self.timer.add("perf/actor_critic_swap_time", turns.seconds)
        self.step_metrics.update({f"train/{k}": v for k, v in metrics.items()})
        self.timer.add("perf/train_time", time.perf_counter() - t0)

    def save_due(self, step: int) -> bool:
        cfg = self.cfg
        last = step == cfg.num_rollout - 1
        return self.backend is not None and (last or (cfg.save_interval > 0
                                                      and (step + 1) % cfg.save_interval == 0))

    def save(self, step: int) -> None:
        """Checkpoint after `step` (logged already). Its time shows as perf/save_time in the
        next step's metrics."""
        t0 = time.perf_counter()
        extra = {"step": step, "data": self.data_state(),
                 "model": model_fingerprint(self.cfg.hf_checkpoint), "lora": lora_fingerprint(self.cfg)}
        box = [extra]
        if self.world > 1:  # the data state lives on rank 0; every rank writes the same extra
            dist.broadcast_object_list(box, src=0)
        self.backend.save_checkpoint(checkpoint_path(self.cfg.run_dir, step), box[0])
        if step == self.cfg.num_rollout - 1 and self.cfg.save_hf_at_end:
            self.backend.export_hf(Path(self.cfg.run_dir) / "hf")
        self.timer.add("perf/save_time", time.perf_counter() - t0)

    def data_state(self) -> dict | None:
        """What a checkpoint keeps of the data source (the fully-async runtime adds the prompts
        still generating or waiting, so a resume generates them again)."""
        return self.data.state_dict() if self.data is not None else None

    def eval_due(self, step: int) -> bool:
        cfg = self.cfg
        return cfg.eval_interval > 0 and ((step + 1) % cfg.eval_interval == 0
                                          or step == cfg.num_rollout - 1)

    def evaluate(self, step: int) -> None:
        """Rank 0 scores the weights just sent (version step+1) on the eval prompts; the score
        is logged with this step, or counted as skipped with the reason."""
        if not self.lead:
            return
        cfg = self.cfg
        t0 = time.perf_counter()
        sampling = eval_sampling(cfg, cfg.seed + 1 if cfg.deterministic else None)  # not the rollouts' seeds
        # Multi-LoRA: each adapter's prompts (their requests name it), metrics eval/<adapter>/...
        sets = ({f"eval/{n}/": items for n, items in self.adapter_eval_items.items()}
                if self.adapter_eval_items else {"eval/": self.eval_items})
        for prefix, items in sets.items():
            result = asyncio.run(self._with_clients(lambda clients, items=items: evaluate_on_engines(
                clients, items, cfg.n_samples_per_eval_prompt, sampling, self.reward_fn,
                self.group_reward_fn, expected_version=str(step + 1),
                max_concurrency=cfg.rollout_max_concurrency)))
            self.step_metrics.update({f"{prefix}{k}": v for k, v in result.metrics.items()})
            self.step_metrics[f"{prefix}skipped"] = float(result.skipped_reason is not None)
        self.timer.add("perf/eval_time", time.perf_counter() - t0)

    async def _with_clients(self, use: Callable[[list[EngineClient]], Awaitable[T]]) -> T:
        # Every request names the trained adapter; multi-LoRA: its prompt's (metadata "lora_adapter").
        lora = POLICY_ADAPTER if self.cfg.lora_rank and not self.cfg.adapters else None
        clients = [EngineClient(url, lora_path=lora) for url in self.engine_urls]
        try:
            return await use(clients)
        finally:
            for c in clients:
                await c.aclose()

    def offload_trainer(self) -> None:
        if self.backend is not None and self.cfg.offload_train:
            stats = self.backend.offload()
            if stats is not None:
                self.timer.add("perf/offload_time", stats.seconds)

    def onload_trainer(self) -> None:
        if self.backend is not None:
            stats = self.backend.onload()
            if stats is not None:
                self.timer.add("perf/onload_time", stats.seconds)

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
            self.step_metrics.update(stats.metrics or {})  # disk-delta: changed fraction, bytes
        else:
            for _ in named:  # take part in the gathers
                pass
        self.timer.add("perf/update_weights_time", time.perf_counter() - t0)

    def log(self, step: int, step_start: float) -> None:
        """Write the step's metrics. Called before the step's checkpoint, so a step a checkpoint
        holds is always in metrics.jsonl (a step logged but not saved is redone, and its line
        replaced, on resume)."""
        self.timer.add("perf/step_time", time.perf_counter() - step_start)
        if self.lead:
            merged = {**self.step_metrics, **self.timer.times}
            if step % self.cfg.log_interval == 0 or step == self.cfg.num_rollout - 1:
                self.metrics.log(step, merged)
            self.progress.update(step, merged)
        self.step_metrics = {}
        self.timer = StepTimer()

    def close(self) -> None:
        if self.agentic is not None:
            self.agentic.close()
        if self.lead:
            self.metrics.close()
            self.progress.close()
        if self.weights is not None:
            self.weights.close()
