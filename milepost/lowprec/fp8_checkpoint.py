"""Helpers over quantized checkpoints that need no engine: FP8 blockwise tensors for a disk update,
the unquantized weights a checkpoint keeps, and a whole checkpoint dequantized (the Megatron
reader). The layouts and their refusals: lowprec/quant_checkpoint.py (detection, no torch) and
lowprec/checkpoint_weights.py (tensors as the engine stores them).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from milepost.lowprec.quant_checkpoint import CheckpointQuant, checkpoint_quant

if TYPE_CHECKING:  # unquantized_weights runs in the config check, without torch
    import torch

    from milepost.lowprec.quantize import QTensor

SCALE_INV_SUFFIX = ".weight_scale_inv"
_BLOCK = CheckpointQuant("fp8_block", "dynamic", (), SCALE_INV_SUFFIX)


def checkpoint_qtensor(name: str, weight: torch.Tensor, scale_inv: torch.Tensor | None) -> QTensor:
    """The QTensor of FP8 blockwise checkpoint tensor `name` (float8_e4m3fn) from its
    `weight_scale_inv`, as stored; a missing or misshapen scale is refused."""
    from milepost.lowprec.checkpoint_weights import read_weight

    scale = name.removesuffix(".weight") + SCALE_INV_SUFFIX
    return read_weight(_BLOCK, name, weight, lambda n: scale_inv if n == scale else None)


def unquantized_weights(path: str | Path) -> list[str]:
    """The `*.weight` tensors a quantized checkpoint stores unquantized (its modules_to_not_convert
    / ignore list, embeddings, norms), read from the safetensors headers alone."""
    from safetensors import safe_open

    out = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out += [n for n in h.keys() if n.endswith(".weight")
                    and not h.get_slice(n).get_dtype().startswith("F8")]
    return out


def dequantize_state(path: str | Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (a whole checkpoint read as stored) with each quantized weight dequantized to
    float32 (the loaders' function) under its HF name and its scales dropped; an unquantized
    checkpoint's tensors are returned as they are."""
    from milepost.lowprec.checkpoint_weights import dequantize_tensors

    return dequantize_tensors(checkpoint_quant(path), tensors)
