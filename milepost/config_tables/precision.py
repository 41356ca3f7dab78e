"""The precision table: which low-precision format the trainer and the engines run (report 3.1,
docs/low_precision.md); the refusals live in milepost/lowprec/rules.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from milepost.config_tables.base import Table

SideFormat = Literal["bf16", "fp8_block", "mxfp8", "nvfp4", "int4"]


class PrecisionTable(Table):
    precision: Literal["bf16", "bf16-train-fp8-serve", "fp8", "mxfp8", "nvfp4", "int4"] = Field(
        "bf16", description="The arrangement: bf16 = nothing quantized (weights in --dtype); "
        "bf16-train-fp8-serve = the trainer keeps --dtype, the engines serve FP8 blockwise "
        "(128x128 weight tiles, 1x128 activation blocks) re-quantized on every update, TIS on by "
        "default; fp8 / mxfp8 / nvfp4 = trainer and engines in that format (one quantizer); "
        "MoE experts: FP8 on fp8_block engines (W8A16), bf16 in the trainer (docs/low_precision.md); "
        "int4 = quantization-aware training (fake-quant weights, straight-through gradients) "
        "and INT4 weights on the engines.")
    train_precision: SideFormat | None = Field(
        None, description="The trainer's format, instead of the one --precision gives "
        "(refused where the contract forbids the pair).")
    rollout_precision: SideFormat | None = Field(
        None, description="The engines' format, instead of the one --precision gives "
        "(nvfp4 rollout with a bf16 trainer is refused).")
    precision_override: list[str] | None = Field(
        None, description="PATTERN=bf16 entries: tensors whose HF name matches the glob PATTERN, "
        "or layers.A-B, stay unquantized at all four stages (checkpoint conversion, trainer, "
        "engines, weight export).")
    nvfp4_four_over_six: bool = Field(
        False, description="NVFP4: scale each 16-value block to 4 or to 6, whichever quantizes it "
        "with less error; part of the contract (both sides quantize alike).")
    nvfp4_dequantized_backward: bool = Field(
        False, description="NVFP4 trainer: run the backward GEMMs in --dtype on the forward's "
        "dequantized operands (gradient stability for throughput).")
