"""`MegatronScorer`: token log-probs and entropies of packed sequences under one GPTModel shard.

The packed micro-batch runs as one sequence with a block-causal mask; logits are gathered to the
full vocabulary (parallel_output off) before the log-softmax. Under EP the token count is padded to
the longest over the expert-parallel group, under sequence parallel (MoE with TP) to a multiple of
TP; with R3 the engine's expert ids are replayed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from milepost.train.logprobs import PackedBatch
from milepost.train.megatron.cpu_shim import block_causal_mask
from milepost.train.megatron.replay import ReplayRouting


class MegatronScorer:
    """Log-probs and entropies of packed sequences under one GPTModel shard (full-vocab logits)."""

    def __init__(self, model: Any, temperature: float, dtype: torch.dtype, pad_group: Any = None,
                 pad_multiple: int = 1) -> None:
        """pad_group: ranks whose micro-batches must have equal token counts (megatron's allgather
        MoE dispatcher gathers equal-sized token blocks over the expert-parallel group);
        pad_multiple: the token count must divide by it (sequence parallel splits it over TP)."""
        self.model = model
        self.temperature = temperature
        self.dtype = dtype
        self.pad_group = pad_group
        self.pad_multiple = pad_multiple
        self.r3 = (0.0, 0.0)

    def prepare(self, packed: PackedBatch, forced: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                min_tokens: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The model's inputs for a packed micro-batch: ids [T'], positions [T'], the block-causal
        mask and the R3 ids, padded to T' >= min_tokens tokens (a collective over pad_group when set)."""
        device = packed.input_ids.device
        lengths = packed.cu_seqlens.diff().tolist()
        ids, pos = packed.input_ids, packed.positions
        target = max(ids.numel(), min_tokens)
        if self.pad_group is not None:
            longest = torch.tensor([target], device=device)
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.pad_group)
            target = int(longest)
        target = -(-target // self.pad_multiple) * self.pad_multiple
        pad = target - ids.numel()
        if pad:  # a padding sequence of its own: masked from the others, none of its rows scored
            ids = torch.cat([ids, ids.new_zeros(pad)])
            pos = torch.cat([pos, torch.arange(pad, device=device)])
            lengths = lengths + [pad]
            if forced is not None:  # any valid ids for the padding rows (they train nothing)
                k = forced.shape[-1]
                filler = torch.arange(k, device=forced.device).expand(pad, forced.shape[1], k)
                forced = torch.cat([forced, filler])
                valid = torch.cat([valid, torch.zeros(pad, dtype=torch.bool)])
        return ids, pos, block_causal_mask(lengths, device), forced, valid

    def finish(self, logits: torch.Tensor, packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the targets and entropies of the scored rows, from logits [T', V]."""
        logits = logits.index_select(0, packed.rows).float()  # [N, V]: TP-gathered (parallel_output off)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(1, packed.targets[:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy

    def score(self, packed: PackedBatch, forced: torch.Tensor | None = None,
              valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forced [T, layers, top_k] / valid [T]: routing replay (R3); `self.r3` holds its counts."""
        ids, pos, mask, forced, valid = self.prepare(packed, forced, valid)
        replay = ReplayRouting(self.model, forced, valid)
        with replay, torch.autocast(ids.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            logits = self.model(ids[None], pos[None], attention_mask=mask)[0]
        self.r3 = replay.counts()
        return self.finish(logits, packed)
