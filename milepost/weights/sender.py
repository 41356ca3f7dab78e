"""The trainer's side of a distributed weight update, matching the engine's `from_distributed`.

SGLang's protocol: the trainer POSTs `/update_weights_from_distributed` with names, dtypes and
shapes, and at the same time broadcasts the tensors, in that order, over the weight group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from milepost.weights.process_group import WeightGroup


def describe_named_tensors(
    named: Sequence[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) as the request fields of `/update_weights_from_distributed`.

    dtypes are bare torch names ("bfloat16"), which SGLang and our engine both accept.
    """
    names = [name for name, _ in named]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    return names, dtypes, shapes


def broadcast_named_tensors(group: WeightGroup, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Send `named` from this rank (the trainer, rank 0) to every engine rank of `group`.

    Tensors are moved to the group's device (CPU for gloo, CUDA for nccl) if needed; the engine
    receives them in the same order, so send exactly what `describe_named_tensors` described.
    """
    if group.rank != 0:
        raise ValueError(
            f"broadcast_named_tensors sends from rank 0; this is rank {group.rank} of {group.name!r}"
        )
    device = group.device
    tensors = [t.detach().to(device) for _, t in named]
    group.broadcast_many(tensors, src=0)
