"""Whether the row-scaled fp8 store's linears quantize their inputs per token (W8A8): a
compressed-tensors FP8-dynamic checkpoint served as stored (`input_activations: dynamic,
strategy: token`) means it, unless the engine runs with `--fp8-weight-only` (W8A16). The
layerwise start (engine_load.py) and the whole-model one (testing/whole_start.py) both ask here.
MoE experts of such a checkpoint stay W8A16 (the fused FP8 MoE kernels take no per-token input
scales yet: docs/low_precision.md)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

from milepost.lowprec.quant_checkpoint import CheckpointQuant

log = logging.getLogger(__name__)


def token_activations(args: object, ckpt: CheckpointQuant | None, served_as_stored: bool) -> bool:
    """True where `--quantization fp8` serves an FP8-dynamic checkpoint as stored and
    `--fp8-weight-only` is unset."""
    return (getattr(args, "quantization", None) == "fp8" and served_as_stored and ckpt is not None
            and ckpt.layout == "fp8_channel" and ckpt.activation_scheme == "dynamic"
            and not getattr(args, "fp8_weight_only", False))


def quantize_inputs_per_token(linears: Iterable[nn.Module]) -> int:
    """Turn the row store's linears (engine/weight_fp8.Fp8Linear) W8A8 and probe the rowwise
    GEMM now (at start, not inside a CUDA graph capture); returns how many."""
    from milepost.kernels.fp8_rowwise import rowwise_backend

    mods = list(linears)
    for m in mods:
        m.act_per_token = True
    if mods:
        rowwise_backend(mods[0].weight.device)
        log.info("FP8-dynamic checkpoint: %d linears quantize their inputs per token (W8A8); MoE "
                 "experts, if any, stay W8A16 (--fp8-weight-only: all W8A16)", len(mods))
    return len(mods)
