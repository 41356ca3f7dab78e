"""Engine start with `--quantization fp8_block|mxfp8|nvfp4|int4`: the contract from the server's
flags, the weights quantized, and a warning where the device has no native GEMM for the format
(emulated: the values are the format's, the speed is not)."""

from __future__ import annotations

import logging
from collections.abc import Collection

import torch
from torch import nn

from milepost.lowprec.contract import BF16, Contract, native_support, parse_overrides
from milepost.lowprec.engine_scales import load_checkpoint_scales
from milepost.lowprec.engine_store import QuantizedWeights, store_quantized
from milepost.lowprec.quantize import QTensor

log = logging.getLogger(__name__)


def engine_contract(quantization: str, precision_override: str | None,
                    four_over_six: bool) -> Contract:
    overrides = parse_overrides(precision_override.split(",")) if precision_override else ()
    return Contract(quantization, quantization, overrides, four_over_six)


def store_engine_precision(model: nn.Module, args: object, device: torch.device,
                           fp8_weights: dict[str, QTensor] | None = None) -> QuantizedWeights:
    """`fp8_weights`: an FP8 checkpoint's QTensors by HF name (registry.load_native), stored as
    they are; the covered tensors the checkpoint kept unquantized stay in the model dtype."""
    fmt = args.quantization  # type: ignore[attr-defined]
    contract = engine_contract(fmt, getattr(args, "precision_override", None),
                               getattr(args, "nvfp4_four_over_six", False))
    if fp8_weights is not None:
        contract = checkpoint_contract(contract, model.hf_weight_names(), fp8_weights)
    warn_emulated(fmt, device)
    store = store_quantized(model, contract, static_scales=static_scales(args), preset=fp8_weights,
                            w8a8_experts=getattr(args, "fp8_w8a8_experts", False))
    read_input_scales(store, args)
    return store


def static_scales(args: object) -> bool:
    return getattr(args, "fp8_activation_scheme", "dynamic") == "static"


def warn_emulated(fmt: str, device: torch.device) -> None:
    """A warning where `device` has no native GEMM for `fmt` (the values are the format's)."""
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if fmt == "int4":  # stored packed everywhere; the W4A16 kernel needs CUDA (bf16 tl.dot: 8.0+)
        if cap is None or cap < (8, 0):
            log.warning("--quantization int4: %s has no W4A16 kernel here; each GEMM unpacks "
                        "and dequantizes the packed weight (the format's values and bytes held, "
                        "not its speed)", f"compute capability {cap}" if cap else "the CPU")
    elif not native_support(fmt, cap):
        log.warning("--quantization %s: %s has no native %s GEMM; emulated (quantize, "
                    "dequantize, GEMM in the model dtype): the format's values, not its speed",
                    fmt, f"compute capability {cap}" if cap else "the CPU", fmt)


def read_input_scales(store: QuantizedWeights, args: object) -> None:
    if store.input_scales is not None:  # a checkpoint's own static scales (activation_scheme static)
        n = load_checkpoint_scales(store.input_scales, str(args.model_path))  # type: ignore[attr-defined]
        log.info("--fp8-activation-scheme static: %d linears, %d input scales read from the "
                 "checkpoint (the others scale dynamically until an update sends them)",
                 len(store.input_scales.names()), n)


def checkpoint_contract(contract: Contract, names: list[str], fp8_weights: Collection[str]
                        ) -> Contract:
    """`contract` with the covered tensors an FP8 checkpoint kept unquantized (its
    modules_to_not_convert, or any covered weight not stored as float8) overridden to bf16 by
    exact name, so they stay in the model dtype at load and on every update; the checkpoint's
    float8 tensors the contract keeps in bf16 (not covered, or overridden) stay dequantized.
    `fp8_weights`: the names of the checkpoint's quantized weights (a dict of their QTensors
    will do)."""
    if not fp8_weights:
        raise ValueError("config.json has an FP8 quantization_config but no weight is float8_e4m3fn: "
                         "remove quantization_config from config.json (the weights are unquantized)")
    kept = [n for n in names if n not in fp8_weights and contract.tensor_format(n, "rollout") != BF16]
    served = sum(1 for n in fp8_weights if contract.tensor_format(n, "rollout") != BF16)
    log.info("FP8 checkpoint: %d tensors served from its float8 values and scales as stored, "
             "%d float8 tensors dequantized into the model dtype (outside the recipe or "
             "overridden), %d covered tensors kept unquantized as the checkpoint stores them",
             served, len(fp8_weights) - served, len(kept))
    return Contract(contract.train, contract.rollout, contract.overrides + tuple((n, BF16) for n in kept),
                    contract.four_over_six)
