"""The trainer rank's parts of fully asynchronous RL (report section 2.2); the loop is fully_async.py.

Rank 0 owns the rollout worker (a background thread generating into the buffer), the buffer and
the prompt ledger; each step it takes a batch and hands it to the other ranks like the sync loop
does. The trainer's weight version is the number of finished steps: step s trains at version s,
and its update makes the engines report s + 1. Weight updates pause the engines with
`--pause-generation-mode` (retract / in_place: in-flight trajectories continue under the new
weights, each token recording its version; abort: they end and their groups take the retry path).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch.distributed as dist

from milepost.config import TrainConfig
from milepost.data.accounting import PromptLedger
from milepost.data.buffer import BufferClosed, BufferSettings, GroupBuffer
from milepost.driver.preflight import RunError, load_fully_async_plugins
from milepost.driver.runtime import Runtime
from milepost.driver.sampling_settings import eval_sampling, rollout_sampling
from milepost.eval.dedicated import DedicatedFleet
from milepost.eval.external import ExternalEvaluator, load_backend
from milepost.lora.multi_data import adapter_metrics
from milepost.lora.settings import POLICY_ADAPTER
from milepost.rollout.client import SyncEngineClient
from milepost.rollout.generate import RolloutResult, rollout_metrics
from milepost.rollout.scheduler import RolloutWorker, WorkerSettings
from milepost.types import Group

log = logging.getLogger(__name__)
PREFIX = "rollout/fully_async/"
ACCOUNTING_FILE = "fully_async_accounting.json"
EVAL_DRAIN_S = 300.0  # at the end, how long outstanding external evaluations may still take


class FullyAsyncRuntime(Runtime):
    def __init__(self, cfg: TrainConfig, engine_urls: list[str], router_url: str | None) -> None:
        super().__init__(cfg, engine_urls, router_url)
        self.worker: RolloutWorker | None = None
        self.external: ExternalEvaluator | None = None
        self.fleet: DedicatedFleet | None = None
        if not self.lead:
            return
        buffer_cls, group_filter = load_fully_async_plugins(cfg)
        self.ledger = PromptLedger(self.data)
        self.buffer = (buffer_cls or GroupBuffer)(BufferSettings(
            capacity=int(cfg.buffer_capacity_factor * cfg.rollout_batch_size),
            max_staleness=cfg.max_staleness, stale_policy=cfg.stale_group_policy,
            aborted_policy=cfg.aborted_group_policy, group_filter=group_filter), self.ledger.drop)
        sampling = rollout_sampling(cfg, seed=None)
        # Agentic runs (issue 6): each trajectory goes through the run's generate / agent fn.
        trajectory_fn, reward_fn = (self.agentic.for_worker(self.reward_fn)
                                    if self.agentic is not None else (None, self.reward_fn))
        self.worker = RolloutWorker(
            engine_urls, self.ledger, self.buffer, sampling, reward_fn, self.group_reward_fn,
            WorkerSettings(cfg.n_samples_per_prompt, int(cfg.max_inflight),
                           cfg.rollout_granularity or "sample",
                           # multi-LoRA: each prompt's adapter (generate_one reads its metadata)
                           lora_path=POLICY_ADAPTER if cfg.lora_rank and not cfg.adapters else None),
            trajectory_fn=trajectory_fn,
            finish_group=None if self.teachers is None else self.teachers.score_group,
            top_logprobs_num=cfg.opd_top_k)
        self._pausers = [SyncEngineClient(url) for url in engine_urls]
        self.fleet = self._start_eval_fleet() if cfg.eval_mode == "dedicated" else None
        backend = self.fleet if self.fleet is not None else (
            load_backend(cfg.eval_backend) if cfg.eval_mode == "external" else None)
        if backend is not None:
            self.external = ExternalEvaluator(backend, cfg.eval_prompt_data, cfg.run_dir,
                                              cfg.max_outstanding_evals)

    def _start_eval_fleet(self) -> DedicatedFleet:
        cfg = self.cfg
        sampling = eval_sampling(cfg, seed=None)
        return DedicatedFleet(cfg.hf_checkpoint, cfg.eval_num_engines,
                              Path(cfg.run_dir) / "logs", self.eval_items,
                              cfg.n_samples_per_eval_prompt, sampling, self.reward_fn,
                              self.group_reward_fn, dtype=cfg.dtype,
                              max_concurrency=int(cfg.rollout_max_concurrency or 256))

    def start_rollout_worker(self) -> None:
        if self.worker is not None:
            self.worker.start()

    def stop_rollout_worker(self) -> None:
        """Stop generating; write where every drawn prompt went (run_dir/fully_async_accounting.json)."""
        if self.worker is None:
            return
        self.worker.stop()
        if self.external is not None:  # the last evaluations: recorded, not lost
            self.external.collect(self.cfg.num_rollout - 1, wait_s=EVAL_DRAIN_S)
            self.external.close()
        summary = self.ledger.summary()
        summary.update(in_buffer=float(len(self.buffer)),
                       generating=float(self.worker.groups_generating))
        (Path(self.cfg.run_dir) / ACCOUNTING_FILE).write_text(json.dumps(summary, indent=1))
        self.worker = None

    def take_batch(self, step: int) -> list[Group]:
        """Rank 0 waits for `rollout_batch_size` fresh groups; every rank receives them."""
        return self._groups_from_lead(lambda: self._take(step), "perf/trainer_wait_time")

    def _take(self, step: int) -> list[Group]:
        try:
            groups = self.buffer.take(self.cfg.rollout_batch_size, trainer_version=step)
        except BufferClosed:
            why = self.worker.error if self.worker is not None else None
            raise RunError(f"the rollout worker stopped ({type(why).__name__}: {why}); check the "
                           f"engine logs under {Path(self.cfg.run_dir) / 'logs'}") from None
        self.ledger.trained_groups(groups)
        replay = rollout_metrics(RolloutResult(groups=groups))
        self.step_metrics.update({f"rollout/{k}": v for k, v in replay.items()
                                  if k not in ("elapsed_s", "tokens_per_s")})
        if self.cfg.adapters:  # multi-LoRA: rollout/<adapter>/reward_mean, ... of the trained groups
            names = [a["name"] for a in self.cfg.adapters]
            self.step_metrics.update({f"rollout/{k}": v for k, v in adapter_metrics(groups, names).items()})
        self.step_metrics.update({PREFIX + k: v for k, v in self.buffer.metrics(step).items()})
        self.step_metrics.update({PREFIX + k: v for k, v in self.worker.read_stats().items()})
        self.step_metrics.update({PREFIX + k: v for k, v in self.ledger.summary().items()})
        if self.teachers is not None:  # scored in the rollout worker since the last step
            self.step_metrics.update({f"opd/{k}": v for k, v in self.teachers.take_metrics().items()})
        # Trajectories a weight update reached mid-generation (they went on under new weights).
        samples = [s for g in groups for s in g]
        self.step_metrics[PREFIX + "mixed_version_frac"] = (
            sum(len(set(s.weight_versions)) > 1 for s in samples) / max(1, len(samples)))
        return groups

    def update_weights(self, step: int, force: bool = False) -> None:
        """Pause the engines (the configured mode) around the update, then let them continue.

        Disk-delta pauses by itself around the reload only (report 4.3: writing and pulling
        the version happen while the engines generate), except for the update that runs
        `--check-weight-update-equal`: that one fills the engines with noise before it sends,
        and nothing may be generated from the noise (tokens tagged "randomized" reached the
        buffer before this pause, and broke the staleness count)."""
        due = force or (step + 1) % self.cfg.update_weights_interval == 0
        randomizes = self.weights is not None and self.weights.check_equal_pending
        if (not (self.lead and due and self.engine_urls and self.backend is not None)
                or (self.cfg.update_weight_transfer_mode == "disk-delta" and not randomizes)):
            return super().update_weights(step, force)
        t0 = time.perf_counter()
        for c in self._pausers:
            c.pause_generation(self.cfg.pause_generation_mode)
        try:
            super().update_weights(step, force)
        finally:
            for c in self._pausers:
                c.continue_generation()
            self.timer.add("perf/generation_pause_time", time.perf_counter() - t0)

    def evaluate(self, step: int) -> None:
        if self.cfg.eval_mode != "shared":  # dedicated fleet or external backend
            return self._evaluate_external(step)
        self._evaluate_shared(step)

    def _evaluate_external(self, step: int) -> None:
        """Export a snapshot (every rank: a collective) and hand it to the backend; training
        goes on. Skipped, with the reason, when too many evaluations are outstanding (no export:
        that would pause training for nothing) or the export fails."""
        box = [self.external.has_room() if self.lead else None]
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        if not box[0]:
            if self.lead:
                self.external.skip(step, step, f"too many evaluations outstanding "
                                   f"(--max-outstanding-evals {self.cfg.max_outstanding_evals})")
            return
        t0 = time.perf_counter()
        snapshot = Path(self.cfg.run_dir) / "eval_snapshots" / f"step_{step:08d}"
        error = None
        try:
            self.backend.export_hf(snapshot)
        except Exception as e:  # noqa: BLE001 - recorded; training never stops for evaluation
            error = f"export failed: {type(e).__name__}: {e}"
        self.timer.add("perf/eval_export_time", time.perf_counter() - t0)
        if self.lead:
            if error is not None:
                self.external.skip(step, step, error)
            else:
                self.external.submit(step, snapshot)

    def log(self, step: int, step_start: float) -> None:
        if self.external is not None:
            self.step_metrics.update(self.external.collect(step))
        super().log(step, step_start)

    def _evaluate_shared(self, step: int) -> None:
        """Shared engines (report table 3): new generation holds while the evaluation runs;
        trajectories already generating go on (same weights: no update happens meanwhile)."""
        if self.worker is not None:
            self.worker.hold()
        try:
            super().evaluate(step)
        finally:
            if self.worker is not None:
                self.worker.release()

    def data_state(self) -> dict | None:
        return self.ledger.data_state() if self.lead else None

    def close(self) -> None:
        try:
            self.stop_rollout_worker()
        finally:
            for c in getattr(self, "_pausers", []):
                c.close()
            if self.fleet is not None:
                self.fleet.close()
            super().close()
