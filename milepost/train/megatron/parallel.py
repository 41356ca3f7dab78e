"""Refuse parallel sizes that do not fit the model or the world, at start, with the numbers.

Megatron's own asserts fire late (inside layer construction) and name its internals; these
checks run before any process group or model is built and name our settings
(--tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size,
--expert-model-parallel-size).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from milepost.train.megatron.shape import ModelShape


@dataclass(frozen=True)
class ParallelSizes:
    """Megatron's parallel sizes; data parallel is what is left of the world."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def data_parallel(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)


def validate_sizes(shape: ModelShape, sizes: ParallelSizes, world_size: int) -> None:
    """Raise ValueError naming the first size that does not divide the model or the world."""
    tp, pp, cp, ep = sizes.tp, sizes.pp, sizes.cp, sizes.ep
    flags = (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
             ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep))
    for flag, value in flags:
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not a multiple of tensor x pipeline x context parallel "
                         f"= {tp} x {pp} x {cp} = {tp * pp * cp}; change the sizes or the number of ranks")
    checks = [
        (shape.num_heads % tp, f"--tensor-model-parallel-size {tp} does not divide the {shape.num_heads} attention heads"),
        (shape.num_kv_heads % tp, (f"--tensor-model-parallel-size {tp} does not divide the {shape.num_kv_heads} "
                                  "key/value heads (query groups)")),
        (shape.vocab_size % tp, (f"--tensor-model-parallel-size {tp} does not divide the vocabulary of "
                                f"{shape.vocab_size} tokens (padding the vocabulary is not implemented)")),
        (shape.ffn_hidden_size % tp, (f"--tensor-model-parallel-size {tp} does not divide the MLP width "
                                     f"{shape.ffn_hidden_size}")),
        (shape.num_layers % pp, f"--pipeline-model-parallel-size {pp} does not divide the {shape.num_layers} layers"),
    ]
    for bad, message in checks:
        if bad:
            raise ValueError(message)
    if ep > 1 and not shape.is_moe:
        raise ValueError(f"--expert-model-parallel-size {ep}: the model has no experts (dense {shape.model_type}); "
                         "set it to 1")
    if shape.is_moe and shape.num_experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {shape.num_experts} experts")
    if world_size % (ep * pp):
        raise ValueError(f"world size {world_size} is not a multiple of expert x pipeline parallel = {ep} x {pp}")
    if cp > 1 and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(f"--context-parallel-size {cp} needs the package transformer-engine (Megatron's context "
                         "parallel attention), which is not installed: pip install transformer-engine[pytorch] "
                         "(CUDA only), or set --context-parallel-size 1")
    if cp > 1:  # with the package present the backend still builds local (non-TE) layers
        raise ValueError(f"--context-parallel-size {cp}: context parallel is not wired in the Megatron backend yet "
                         "(it builds megatron's local layers, whose attention refuses CP, and does not split "
                         "sequences over CP ranks); set --context-parallel-size 1")
