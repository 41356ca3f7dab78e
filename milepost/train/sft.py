"""Supervised fine-tuning on the RL trainer (report 3.4 / 5): the same FSDP backend with `sft_loss`.

Each conversation becomes one `TrainBatch` sample whose every token after the first is scored and
whose loss mask is the assistant-token mask, so the loss is the NLL of assistant tokens only.
Packing: the backend concatenates conversations without padding into micro-batches of up to
max_tokens_per_micro_batch tokens (varlen attention keeps them apart). The data order is a pure
function of (data_seed, epoch), so a resumed run continues with exactly the batches it would have had.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from milepost.data.chat import ChatExample, load_chat_dataset
from milepost.observe.metrics import MetricsLogger
from milepost.sft_config import SFTConfig
from milepost.train.batch import TrainBatch, split_for_rank
from milepost.train.checkpoint import checkpoint_path, latest_checkpoint
from milepost.train.fsdp import FSDPBackend
from milepost.train.settings import TrainerSettings

log = logging.getLogger(__name__)


def sft_trainer_settings(cfg: SFTConfig, total_steps: int) -> TrainerSettings:
    return TrainerSettings(
        lr=cfg.lr, min_lr=cfg.min_lr, lr_warmup_iters=cfg.lr_warmup_iters, lr_decay_style=cfg.lr_decay_style,
        num_steps_total=total_steps, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad,
        global_batch_size=cfg.global_batch_size, max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
        loss_type="sft_loss", loss_aggregation=cfg.loss_aggregation, seed=cfg.seed, dtype=cfg.dtype,
        device=cfg.device, fused_kernels=cfg.fused_kernels,
    )


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The example order of one epoch: a permutation fixed by (seed, epoch)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def examples_batch(examples: list[ChatExample]) -> TrainBatch:
    """Conversations as a TrainBatch: tokens 1.. are scored, the loss mask is the assistant mask."""
    return TrainBatch(
        tokens=[torch.tensor(e.tokens, dtype=torch.int64) for e in examples],
        response_lengths=[len(e.tokens) - 1 for e in examples],
        loss_masks=[torch.tensor(e.mask[1:], dtype=torch.float32) for e in examples],
        advantages=[torch.zeros(len(e.tokens) - 1) for e in examples],  # unused by sft_loss
    )


class SFTRuntime:
    """What one SFT rank holds: data, backend, metrics (rank 0). One method per step of the loop."""

    def __init__(self, cfg: SFTConfig) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
        self.examples, truncated = load_chat_dataset(cfg.sft_data, tokenizer, messages_key=cfg.messages_key,
                                                     max_seq_len=cfg.max_seq_len)
        self.steps_per_epoch = len(self.examples) // cfg.global_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"--sft-data has {len(self.examples)} conversations, fewer than one "
                             f"--global-batch-size ({cfg.global_batch_size}); lower the batch size")
        self.total_steps = self.steps_per_epoch * cfg.num_epoch
        self.backend = FSDPBackend.create(cfg.hf_checkpoint, sft_trainer_settings(cfg, self.total_steps))
        self.start_step = self._resume()
        self.lead = self.rank == 0
        self.metrics = MetricsLogger(cfg.run_dir, start_step=self.start_step) if self.lead else None
        self.step_metrics: dict[str, float] = {"data/truncated": float(truncated)}
        if self.lead:
            log.info("sft: %d conversations (%d truncated), %d steps per epoch, %d steps in all",
                     len(self.examples), truncated, self.steps_per_epoch, self.total_steps)

    def _resume(self) -> int:
        path = latest_checkpoint(self.cfg.run_dir) if self.cfg.resume == "auto" else None
        if path is None:
            return 0
        extra = self.backend.load_checkpoint(path)
        return int(extra["step"]) + 1

    def steps(self) -> range:
        return range(self.start_step, self.total_steps)

    def batch(self, step: int) -> TrainBatch:
        """This rank's share of optimizer step `step` (token-balanced across ranks)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = epoch_order(len(self.examples), self.cfg.data_seed, epoch)
        gbs = self.cfg.global_batch_size
        picked = [self.examples[i] for i in order[within * gbs : (within + 1) * gbs]]
        mine = split_for_rank([len(e.tokens) for e in picked], self.rank, self.world, gbs)
        self.step_metrics["data/epoch"] = float(epoch)
        return examples_batch([picked[i] for i in mine])

    def train(self, batch: TrainBatch) -> None:
        t0 = time.perf_counter()
        metrics = self.backend.train_step(batch)
        seconds = time.perf_counter() - t0
        keep = ("sft_loss", "entropy", "grad_norm", "lr", "tokens", "loss_tokens", "skipped_steps")
        self.step_metrics.update({f"train/{k}": metrics[k] for k in keep})
        self.step_metrics.update({"perf/train_time": seconds, "perf/tokens_per_s": metrics["tokens"] / seconds})

    def log(self, step: int) -> None:
        if self.lead and (step % self.cfg.log_interval == 0 or step == self.total_steps - 1):
            self.metrics.log(step, self.step_metrics)
            log.info("sft step %d/%d: loss %.4f", step + 1, self.total_steps, self.step_metrics["train/sft_loss"])
        self.step_metrics = {}

    def save_due(self, step: int) -> bool:
        interval = self.cfg.save_interval
        return step == self.total_steps - 1 or (interval > 0 and (step + 1) % interval == 0)

    def save(self, step: int) -> None:
        self.backend.save_checkpoint(checkpoint_path(self.cfg.run_dir, step), {"step": step})

    def export(self) -> Path | None:
        if not self.cfg.save_hf_at_end:
            return None
        out = Path(self.cfg.run_dir) / "hf"
        self.backend.export_hf(out)
        return out

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
