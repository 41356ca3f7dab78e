"""The native FP8 trainer linears' quantize passes, as a switch (no Triton import here: CPU-only
installs read it too). The kernels: milepost/kernels/fp8_train_quant.py; the A/B:
benchmarks/fp8_train_profile.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Fp8TrainOptions:
    """Which quantize passes the trainer's native FP8 blockwise linears run (the values are the
    same either way; benchmarks/fp8_train_profile.py A/Bs them). The defaults are the one-pass
    kernels: on an H100 (2026-12-06) they took the Qwen3-4B layer's seven linears (forward and
    backward, 16,384 tokens) from 32.0 ms to 13.3 ms (bf16: 13.5 ms), bit for bit;
    `unfused()` is the earlier path. weight_quant "triton": `quantize_weight_tiles` (one pass,
    and the transposed values the data gradient reads, saved in place of the forward's);
    act_quant "tiled": `quantize_blocks` for the forward and data-gradient inputs (64 rows of
    1 x 128 blocks a program instead of one block); transpose "fused": the weight-gradient
    operands quantized from the transposed views directly (no pad-clone and transposing copy)."""

    weight_quant: Literal["torch", "triton"] = "triton"
    act_quant: Literal["rows", "tiled"] = "tiled"
    transpose: Literal["copy", "fused"] = "fused"

    @classmethod
    def all_fused(cls) -> Fp8TrainOptions:
        return cls("triton", "tiled", "fused")

    @classmethod
    def unfused(cls) -> Fp8TrainOptions:
        """The path before 2026-12-06: the torch weight quantizer, one program per 1 x 128 block,
        transposing copies for the weight gradient."""
        return cls("torch", "rows", "copy")
