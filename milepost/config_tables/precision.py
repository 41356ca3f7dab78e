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
        "MoE experts: FP8 on fp8_block engines (W8A16; W8A8 with --fp8-w8a8-experts), bf16 in the "
        "trainer (docs/low_precision.md); "
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
    precision_bf16_first_layers: int = Field(
        0, ge=0, description="Keep the first N decoder layers' linears in bf16 at all four stages "
        "(resolved against the checkpoint's num_hidden_layers at start into a layers.A-B override).")
    precision_bf16_last_layers: int = Field(
        0, ge=0, description="Keep the last M decoder layers' linears in bf16 at all four stages "
        "(the recipes' final-layer exception; resolved like --precision-bf16-first-layers).")
    fp8_scaling: Literal["current", "delayed"] = Field(
        "current", description="FP8 trainer (--precision fp8): current = a scale per 1x128 block "
        "from the tensor itself (the engines' recipe); delayed = one scale per activation and "
        "output-gradient tensor from the amax history of earlier steps (Transformer Engine's "
        "DelayedScaling; weights keep the shared 128x128 quantizer); the engines take the input "
        "scales with every weight update as static activation scales, so both sides compute alike.")
    fp8_amax_history_len: int = Field(
        1024, ge=1, description="--fp8-scaling delayed: optimizer steps of amax history per tensor.")
    fp8_amax_compute_algo: Literal["max", "most_recent"] = Field(
        "max", description="--fp8-scaling delayed: the scale's amax is the history's largest (max) "
        "or the last step's (most_recent).")
    fp8_margin: int = Field(
        0, ge=0, description="--fp8-scaling delayed: scale so the amax maps to 448 / 2^margin "
        "(headroom for growth between steps).")
    fp8_w8a8_experts: bool = Field(
        False, description="fp8_block engines: the MoE experts quantize their inputs per 1x128 "
        "block too (W8A8, as the dense projections do) instead of keeping them in --dtype (W8A16); "
        "faster at decode batch sizes (docs/low_precision.md), a larger train-rollout gap for TIS "
        "to correct.")
    nvfp4_four_over_six: bool = Field(
        False, description="NVFP4: scale each 16-value block to 4 or to 6, whichever quantizes it "
        "with less error; part of the contract (both sides quantize alike).")
    nvfp4_dequantized_backward: bool = Field(
        False, description="NVFP4 trainer: run the backward GEMMs in --dtype on the forward's "
        "dequantized operands (gradient stability for throughput).")
    nvfp4_stochastic_rounding: bool = Field(
        False, description="NVFP4 trainer: round the output gradient's elements stochastically "
        "(unbiased) in both backward GEMMs, as NVIDIA's NVFP4 training recipe does; activations "
        "and weights stay round-to-nearest-even. Trainer only (the engines never see gradients).")
