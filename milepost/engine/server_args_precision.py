"""Start-time checks of `ServerArgs`' precision settings, and what a quantized checkpoint makes them.

A quantized checkpoint (config.json quantization_config) picks the engine's weight store as SGLang
takes the method from the checkpoint; a layout no store holds, and precision flags that the chosen
store does not use, are refused here, at start (docs/low_precision.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from milepost.engine.server_args import ServerArgs


def checkpoint_quantization(args: ServerArgs) -> str | None:
    """--quantization as the checkpoint makes it: a quantized checkpoint (FP8 blockwise or
    per-tensor: fp8_block; FP8 per-channel: fp8; INT4 pack-quantized: int4) is served by the
    store that holds its values as stored unless --dequantize-checkpoint (as SGLang, which
    takes the method from the checkpoint's quantization_config); a layout the engines cannot
    hold is refused here, at start."""
    from milepost.lowprec.quant_checkpoint import checkpoint_quant, unheld_weights

    ckpt = checkpoint_quant(args.model_path)
    if args.dequantize_checkpoint and ckpt is None:
        raise ValueError(f"--dequantize-checkpoint: {args.model_path / 'config.json'} has no "
                         "quantization_config; drop the flag")
    if args.dequantize_checkpoint and args.quantization:
        raise ValueError(f"--dequantize-checkpoint with --quantization {args.quantization}: "
                         "serving the dequantized weights quantized again; drop one (a quantized "
                         "checkpoint without either is served from its own values)")
    if ckpt is None or args.dequantize_checkpoint or args.quantization:
        return args.quantization  # other formats: re-quantized from the dequantized weights
    if ckpt.inexact:
        raise ValueError(ckpt.inexact)
    unheld = unheld_weights(args.model_path, ckpt)
    if unheld:
        more = f" (and {len(unheld) - 1} more)" if len(unheld) > 1 else ""
        raise ValueError(f"{unheld[0]}{more}: a {ckpt.layout} weight that the {ckpt.serve_as} "
                         "store does not hold (it holds the q/k/v/o and gate/up/down projections "
                         "and MoE experts); serve the checkpoint with "
                         "--dequantize-checkpoint")
    return ckpt.serve_as


def check_precision_flags(args: ServerArgs, quantization: str | None) -> None:
    """The precision flags each name a store; `quantization` is the one the engine serves
    (`checkpoint_quantization`), which may come from the checkpoint rather than --quantization."""
    if (args.precision_override or args.nvfp4_four_over_six) and quantization in (None, "fp8"):
        raise ValueError("--precision-override / --nvfp4-four-over-six need --quantization "
                         "fp8_block, mxfp8 or nvfp4")
    if args.fp8_activation_scheme == "static" and quantization != "fp8_block":
        raise ValueError("--fp8-activation-scheme static scales the fp8_block engine's "
                         "activations; add --quantization fp8_block or drop it")
    if args.fp8_w8a8_experts and quantization != "fp8_block":
        raise ValueError("--fp8-w8a8-experts quantizes the fp8_block engine's MoE expert inputs; "
                         f"the engine serves {quantization or 'no quantized store'} here: add "
                         "--quantization fp8_block or drop it")
    if args.fp8_weight_only and quantization != "fp8":
        raise ValueError("--fp8-weight-only keeps a per-channel FP8 checkpoint's activations in "
                         f"--dtype; the engine serves {quantization or 'no quantized store'} "
                         "here (it needs an FP8-dynamic checkpoint served as stored, or "
                         "--quantization fp8): drop --fp8-weight-only")
    if args.nvfp4_four_over_six and args.quantization != "nvfp4":
        raise ValueError("--nvfp4-four-over-six needs --quantization nvfp4")
    if args.precision_override:
        from milepost.lowprec.contract import parse_overrides

        parse_overrides(args.precision_override.split(","))


def checkpoint_precision(args: ServerArgs) -> dict[str, str]:
    """A quantized checkpoint's settings: its store, and its static input scales
    (`activation_scheme: static`) unless --fp8-activation-scheme was given."""
    from milepost.lowprec.quant_checkpoint import checkpoint_quant

    quantization = checkpoint_quantization(args)
    out = {"quantization": quantization} if quantization != args.quantization else {}
    ckpt = checkpoint_quant(args.model_path)
    if (ckpt is not None and ckpt.activation_scheme == "static" and quantization == "fp8_block"
            and "fp8_activation_scheme" not in args.model_fields_set):
        out["fp8_activation_scheme"] = "static"
    return out
