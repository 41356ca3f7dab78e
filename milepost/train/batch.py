"""`TrainBatch`, one rank's share of a rollout in tensors, and `split_for_rank`, the data-parallel split.

The driver computes advantages over the whole rollout (groups must be complete), builds one
`TrainBatch` from all samples, and hands each rank `batch.select(split_for_rank(...))`. The split
keeps optimizer-step membership: step i of every rank holds its share of the rollout's i-th
`global_batch_size` samples, so N ranks take exactly the optimizer steps one rank would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from milepost.types import Sample


def _f32(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32).detach().cpu().reshape(-1)


@dataclass
class TrainBatch:
    """Per-sample training inputs (CPU tensors; the backend moves them to its device).

    tokens: each [seq_len] int64, prompt + response.
    response_lengths: the last response_lengths[i] tokens of sample i are its response (>= 1, and
        the prompt has >= 1 token, since the first response token is predicted from it).
    loss_masks / advantages: each [response_length] float32.
    rollout_logprobs: each [response_length], the engine's log-probs (for the mismatch metric).
    old_logprobs: each [response_length], the behaviour policy for the PPO ratio; None = the
        backend computes them with its current weights before the first optimizer step.
    ref_logprobs: each [response_length]; None = the backend computes them with its reference model
        when use_kl_loss is on.
    values / returns: each [response_length], the critic's values before training and the value
        targets (PPO); returns set = the backend trains its critic on them.
    routed_experts: each [len(tokens) - 1, layers, top_k] int, the engine's expert ids (R3).
    adapters: multi-LoRA, the name of each sample's adapter (Sample.metadata["lora_adapter"]).
    """

    tokens: list[torch.Tensor]
    response_lengths: list[int]
    loss_masks: list[torch.Tensor]
    advantages: list[torch.Tensor]
    rollout_logprobs: list[torch.Tensor] | None = None
    old_logprobs: list[torch.Tensor] | None = None
    ref_logprobs: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    returns: list[torch.Tensor] | None = None
    routed_experts: list[torch.Tensor] | None = None
    adapters: list[str] | None = None

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.response_lengths) == len(self.loss_masks) == len(self.advantages) == n):
            raise ValueError("TrainBatch: tokens, response_lengths, loss_masks and advantages need one entry per sample")
        for i, (tok, r) in enumerate(zip(self.tokens, self.response_lengths)):
            if tok.dim() != 1 or not 1 <= r < tok.numel():
                raise ValueError(
                    f"TrainBatch sample {i}: need 1 <= response_length ({r}) < len(tokens) ({tok.numel()}); "
                    "a response needs at least one prompt token before it"
                )
        if self.adapters is not None and len(self.adapters) != n:
            raise ValueError(f"TrainBatch.adapters has {len(self.adapters)} entries for {n} samples")
        if self.routed_experts is not None:
            if len(self.routed_experts) != n:
                raise ValueError(f"TrainBatch.routed_experts has {len(self.routed_experts)} entries for {n} samples")
            for i, (r, tok) in enumerate(zip(self.routed_experts, self.tokens)):
                if r.dim() != 3 or r.shape[0] != tok.numel() - 1:
                    raise ValueError(
                        f"TrainBatch.routed_experts[{i}] has shape {tuple(r.shape)}, expected "
                        f"({tok.numel() - 1}, layers, top_k)"
                    )
        for field in ("loss_masks", "advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "returns"):
            values = getattr(self, field)
            if values is None:
                continue
            if len(values) != n:
                raise ValueError(f"TrainBatch.{field} has {len(values)} entries for {n} samples")
            for i, (v, r) in enumerate(zip(values, self.response_lengths)):
                if v.shape != (r,):
                    raise ValueError(f"TrainBatch.{field}[{i}] has shape {tuple(v.shape)}, expected ({r},)")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_samples(
        cls,
        samples: Sequence[Sample],
        advantages: Sequence[torch.Tensor],
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
        values: Sequence[torch.Tensor] | None = None,
        returns: Sequence[torch.Tensor] | None = None,
        routed_experts: Sequence[torch.Tensor] | None = None,
    ) -> TrainBatch:
        """Tensors from `Sample`s; an empty loss_mask means all ones, rollout log-probs are kept only
        when every sample has them."""
        masks = [
            _f32(s.loss_mask) if s.loss_mask else torch.ones(s.response_length, dtype=torch.float32)
            for s in samples
        ]
        rollout = None
        if samples and all(len(s.rollout_logprobs) == s.response_length for s in samples):
            rollout = [_f32(s.rollout_logprobs) for s in samples]
        return cls(
            tokens=[torch.as_tensor(s.tokens, dtype=torch.int64) for s in samples],
            response_lengths=[s.response_length for s in samples],
            loss_masks=masks,
            advantages=[_f32(a) for a in advantages],
            rollout_logprobs=rollout,
            old_logprobs=None if old_logprobs is None else [_f32(x) for x in old_logprobs],
            ref_logprobs=None if ref_logprobs is None else [_f32(x) for x in ref_logprobs],
            values=None if values is None else [_f32(x) for x in values],
            returns=None if returns is None else [_f32(x) for x in returns],
            routed_experts=None if routed_experts is None else list(routed_experts),
            adapters=adapters_of(samples),
        )

    def select(self, indices: Sequence[int]) -> TrainBatch:
        """The samples at `indices`, in that order."""

        def pick(values: list | None) -> list | None:
            return None if values is None else [values[i] for i in indices]

        return TrainBatch(
            tokens=pick(self.tokens),
            response_lengths=pick(self.response_lengths),
            loss_masks=pick(self.loss_masks),
            advantages=pick(self.advantages),
            rollout_logprobs=pick(self.rollout_logprobs),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            values=pick(self.values),
            returns=pick(self.returns),
            routed_experts=pick(self.routed_experts),
            adapters=pick(self.adapters),
        )


def adapters_of(samples: Sequence[Sample]) -> list[str] | None:
    """Multi-LoRA: each sample's adapter, when the rollout named one for every sample."""
    names = [s.metadata.get("lora_adapter") for s in samples]
    if not names or any(n is None for n in names):
        return None
    return names


def split_for_rank(
    lengths: Sequence[int] | Sequence[Sample], rank: int, world_size: int, global_batch_size: int
) -> list[int]:
    """Indices of the samples rank `rank` trains on, step by step, balancing tokens across ranks.

    `lengths` are the samples' token counts (or the samples themselves). Each consecutive chunk of
    `global_batch_size` samples is one optimizer step; within it every rank gets exactly
    global_batch_size / world_size samples, longest first to the rank with the fewest tokens so far
    (ties to the lower rank). Deterministic, so every rank computes the same split independently.
    """
    sizes = [len(x.tokens) if isinstance(x, Sample) else int(x) for x in lengths]
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if global_batch_size % world_size:
        raise ValueError(f"global_batch_size ({global_batch_size}) must be a multiple of the world size ({world_size})")
    if len(sizes) % global_batch_size:
        raise ValueError(
            f"{len(sizes)} samples are not a whole number of optimizer steps of global_batch_size="
            f"{global_batch_size}; make the rollout batch a multiple of it"
        )
    per_rank = global_batch_size // world_size
    mine: list[int] = []
    for start in range(0, len(sizes), global_batch_size):
        chunk = range(start, start + global_batch_size)
        tokens, members = [0] * world_size, [[] for _ in range(world_size)]
        for i in sorted(chunk, key=lambda j: (-sizes[j], j)):
            r = min((r for r in range(world_size) if len(members[r]) < per_rank), key=lambda r: (tokens[r], r))
            members[r].append(i)
            tokens[r] += sizes[i]
        mine += sorted(members[rank])
    return mine
