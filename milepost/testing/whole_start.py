"""A quantized engine's model the whole-model way: every layer loaded in `--dtype` first, then
fused, then stored (`store_engine_precision` / `store_fp8`, with a quantized checkpoint's own
values where its store holds them). What every `--quantization` start did before the layerwise
start (lowprec/engine_load.py), and still what a model handed to `build_engine` gets: tests
compare the two bit for bit, and benchmarks/engine_start_memory.py measures both."""

from __future__ import annotations

import torch

from milepost.engine.server_args import ServerArgs
from milepost.engine.weight_fp8 import store_fp8
from milepost.lowprec.engine_setup import store_engine_precision
from milepost.lowprec.fp8_dynamic import quantize_inputs_per_token, token_activations
from milepost.lowprec.quant_checkpoint import checkpoint_quant
from milepost.lowprec.quantize import QTensor
from milepost.models.base import CausalLM
from milepost.models.registry import load_model


def quantize_after_build(args: ServerArgs, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The model for resolved `args` (with `--quantization`), built whole then stored."""
    ckpt = checkpoint_quant(args.model_path)
    stored: dict[str, QTensor] | None = (
        {} if ckpt is not None and args.quantization == ckpt.serve_as and not ckpt.inexact else None)
    model = load_model(args.model_path, dtype, device, fp8_weights=stored)
    model.fuse_projections()
    if args.quantization == "fp8":
        store = store_fp8(model, stored)
        if token_activations(args, ckpt, stored is not None):  # FP8-dynamic: W8A8
            quantize_inputs_per_token(store._modules)
    else:
        store_engine_precision(model, args, device, stored)
    return model


def served_args(args: ServerArgs) -> ServerArgs:
    """`args` for an engine handed a model already stored by `quantize_after_build`: no
    `--quantization` (the model holds its store; `build_engine` would store it again)."""
    quantized = checkpoint_quant(args.model_path) is not None
    return ServerArgs(**{**args.model_dump(exclude={"quantization", "precision_override",
                                                     "nvfp4_four_over_six", "fp8_activation_scheme",
                                                     "fp8_weight_only"}),
                         "dequantize_checkpoint": quantized}).resolved()
