"""The native FP8 trainer linears' quantize passes, as a switch (no Triton import here: CPU-only
installs read it too). The kernels: milepost/kernels/fp8_train_quant.py; the A/B:
benchmarks/fp8_train_profile.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Fp8TrainOptions:
    """Which quantize passes the trainer's native FP8 blockwise linears run (the values are the
    same either way; defaults are the path measured on 2026-12-05, so a GPU run can A/B them:
    benchmarks/fp8_train_profile.py). weight_quant "triton": `quantize_weight_tiles` (one pass,
    and the transposed values the data gradient reads, saved in place of the forward's);
    act_quant "tiled": `quantize_blocks` for the forward and data-gradient inputs (64 rows of
    1 x 128 blocks a program instead of one block); transpose "fused": the weight-gradient
    operands quantized from the transposed views directly (no pad-clone and transposing copy)."""

    weight_quant: Literal["torch", "triton"] = "torch"
    act_quant: Literal["rows", "tiled"] = "rows"
    transpose: Literal["copy", "fused"] = "copy"

    @classmethod
    def all_fused(cls) -> Fp8TrainOptions:
        return cls("triton", "tiled", "fused")
