"""`TrainBackend`: the one protocol the driver, weight transports and recipes are written against.

A backend owns a model replica group: every rank of the default process group holds one
`TrainBackend`, and every method below is called on every rank in the same order (they contain
collectives). FSDP2 (milepost/train/fsdp.py) is the first implementation; Megatron comes later.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from milepost.train.batch import TrainBatch, split_for_rank
from milepost.types import Sample

__all__ = ["TRAIN_METRICS", "TrainBackend", "TrainBatch", "create_backend", "split_for_rank"]

# Keys of the dict `train_step` returns (train_rollout_logprob_abs_diff only when the batch has
# rollout log-probs). Values are identical on every rank.
TRAIN_METRICS = (
    "loss",  # total objective per optimizer step (mean over steps)
    "pg_loss",  # PPO-clip policy term, mean over all loss tokens of the call
    "pg_clipfrac",  # share of loss tokens whose clipped term was taken
    "ppo_kl",  # mean (old_logp - logp) over loss tokens
    "kl",  # mean KL estimate to the reference model over loss tokens (0 without one)
    "entropy",  # mean token entropy over loss tokens
    "grad_norm",  # global grad norm before clipping (mean over steps)
    "lr",  # learning rate of the last optimizer step
    "train_rollout_logprob_abs_diff",  # mean |old_logp - rollout_logp| over loss tokens
    "tokens",  # tokens (prompt + response) trained on, all ranks
    "loss_tokens",  # loss-mask tokens, all ranks
    "optimizer_steps",  # optimizer steps in this call
    "skipped_steps",  # of which skipped because the gradient norm was nan/inf
)
# Present only when their feature is on (milepost/train/losses.py, corrections.py, critic.py, replay.py):
# sft_loss (loss_type sft_loss); value_loss, value_clipfrac (a critic trained on TrainBatch.returns);
# rollout_ratio, rollout_ratio_clipfrac, rollout_ratio_abs_dev (ratio_correction: pre-clamp mean r,
# share of tokens outside the interval, mean |r - 1|); r3_routing_mismatch_frac (routing replay).


@runtime_checkable
class TrainBackend(Protocol):
    """A distributed trainer of one policy (plus an optional frozen reference model).

    Data parallel: each rank passes only its own samples (see `split_for_rank`); every rank must
    pass the same number of samples, a multiple of global_batch_size / world_size.
    """

    rank: int
    world_size: int

    def compute_logprobs(self, samples: Sequence[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        """Log-probs of each sample's response tokens: [response_length] fp32 on CPU, no grad.

        reference=True scores with the frozen reference model (only when one exists).
        """
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Train on one rollout's worth of local samples; returns `TRAIN_METRICS` averaged.

        The batch is cut into optimizer steps of global_batch_size samples (over all ranks) and
        each step into micro-batches of at most max_tokens_per_micro_batch tokens; gradients
        accumulate over micro-batches, then clip, AdamW step, LR schedule step.
        """
        ...

    def named_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under Hugging Face names, in the compute dtype, on the device.

        A collective: every rank must iterate it to the end, in step. Every rank yields the same
        names and full tensors; senders use rank 0's. Each tensor stays valid after iteration.
        """
        ...

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Atomically write model, optimizer, scheduler, RNG states and the JSON `extra` to `path`."""
        ...

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore everything `save_checkpoint` wrote; returns its `extra`."""
        ...

    def export_hf(self, path: str | Path) -> None:
        """Write a Hugging Face directory (config.json, safetensors, tokenizer files) to `path`."""
        ...

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state (and the reference model) to CPU."""
        ...

    def onload(self) -> None:
        """Bring everything `offload` moved back to the training device."""
        ...


def create_backend(model_path: str | Path, settings: Any, train_backend: str = "fsdp", sizes: Any = None) -> Any:
    """The `TrainBackend` named by --train-backend (collective: every rank calls it).

    sizes: `milepost.train.megatron.parallel.ParallelSizes` for megatron. Ranks of one Megatron
    model-parallel group take the same samples: split with the backend's data_rank / data_world.
    """
    if train_backend == "megatron":
        from milepost.train.megatron.backend import MegatronBackend

        return MegatronBackend.create(model_path, settings, sizes)
    if train_backend != "fsdp":
        raise ValueError(f"--train-backend {train_backend!r}: choose fsdp or megatron")
    if getattr(settings, "use_distributed_optimizer", False):
        raise ValueError("use_distributed_optimizer=True needs --train-backend megatron (FSDP already shards "
                         "the optimizer state over its ranks)")
    from milepost.train.fsdp import FSDPBackend

    return FSDPBackend.create(model_path, settings)
