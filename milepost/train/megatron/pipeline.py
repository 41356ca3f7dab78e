"""Pipeline parallel (PP > 1): packed micro-batches through megatron-core's own 1F1B schedule.

Every stage of a pipeline is given the same samples and plans the same micro-batches; their
lengths differ, so the model config has `variable_seq_lengths` (megatron sends each activation's
shape first); MoE models (megatron's allgather dispatcher refuses that) pad every micro-batch of a
call to the longest. The last stage turns logits into log-probs / the loss (`on_logits`); the loss is
already divided by the global loss-token count, so megatron's per-token mode (no rescaling) is
used. Scores live on the last stage and are broadcast to the others (`broadcast_scores`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from milepost.train.logprobs import PackedBatch
from milepost.train.megatron.scorer import MegatronScorer

# (micro-batch index, logits of the last stage [T', V]) -> the loss to back-propagate, or None
# (forward only)
OnLogits = Callable[[int, torch.Tensor], torch.Tensor | None]


def run_pipeline(scorer: MegatronScorer, micro: Sequence[PackedBatch], on_logits: OnLogits,
                 forward_only: bool) -> None:
    """Forward (and, unless forward_only, backward) every micro-batch through this stage.

    Collective over the pipeline group (and the scorer's pad group): every stage calls it with the
    same micro-batches in the same order. Gradients accumulate in `.grad` (no finalize step:
    the backend sums them over the data-parallel and embedding groups itself)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    inputs = [scorer.prepare(packed)[:3] for packed in micro]  # ids, positions, mask (padded)
    device = micro[0].input_ids.device
    if not scorer.model.config.variable_seq_lengths:  # (MoE) one activation shape for the whole call
        longest = torch.tensor([max(int(x[0].numel()) for x in inputs)], device=device)
        if scorer.pad_group is not None:
            dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=scorer.pad_group)
        inputs = [scorer.prepare(packed, min_tokens=int(longest))[:3] for packed in micro]
    one = torch.ones((), dtype=torch.int, device=device)

    def forward_step(indices: Any, model: Any) -> tuple[torch.Tensor, Callable]:
        i = next(indices)
        ids, pos, mask = inputs[i]
        with torch.autocast(device.type, dtype=scorer.dtype, enabled=scorer.dtype != torch.float32):
            out = model(ids[None], pos[None], attention_mask=mask)

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
            loss = on_logits(i, logits[0])
            return (logits.new_zeros(()) if loss is None else loss), one, {}
        return out, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(range(len(micro))), model=[scorer.model],
        num_microbatches=len(micro), seq_length=max(int(x[0].numel()) for x in inputs), micro_batch_size=1,
        forward_only=forward_only)


def broadcast_scores(scores: list[torch.Tensor | None], lengths: list[int], device: torch.device) -> list[torch.Tensor]:
    """The last stage's per-sample scores (CPU, float32) on every stage of the pipeline."""
    from megatron.core import parallel_state as ps

    flat = torch.zeros(sum(lengths), dtype=torch.float32, device=device)
    if ps.is_pipeline_last_stage():
        flat.copy_(torch.cat([s.reshape(-1) for s in scores]) if scores else flat)
    dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    return list(flat.cpu().split(lengths))
