"""`ServerArgs`' cross-setting refusals: settings valid alone but not together (its model validator).

Each names the flags at fault and the fix. The precision and speculative-decoding groups have their
own modules (server_args_precision.py, server_args_speculative.py); the order here is the order
in which a command line with several faults hears about them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from milepost.engine.server_args_precision import check_precision_flags, checkpoint_quantization
from milepost.engine.server_args_resolve import has_custom_code, model_max_positions
from milepost.engine.server_args_speculative import check_speculative

if TYPE_CHECKING:
    from milepost.engine.server_args import ServerArgs


def check_combinations(args: ServerArgs) -> None:
    """Settings that are valid alone but not together, refused in this order at construction."""
    if args.max_total_tokens is not None and args.max_total_tokens < args.page_size:
        raise ValueError(
            f"--max-total-tokens ({args.max_total_tokens}) must hold at least one page of "
            f"--page-size ({args.page_size}) tokens; raise --max-total-tokens or lower --page-size"
        )
    if not args.trust_remote_code and has_custom_code(args.model_path):
        raise ValueError(
            f"{args.model_path / 'config.json'} has auto_map: the model runs its own modeling code; "
            "review it, then pass --trust-remote-code"
        )
    if (args.lora_paths or args.max_loras_per_batch != 8 or args.lora_target_modules != "all-linear"
            or args.max_lora_rank != 16) and not args.enable_lora:
        raise ValueError("--lora-paths / --max-lora-rank / --lora-target-modules / "
                         "--max-loras-per-batch need --enable-lora")
    quantization = checkpoint_quantization(args)
    check_precision_flags(args, quantization)
    if args.true_on_policy and (quantization or args.enable_lora):
        raise ValueError("--true-on-policy re-scores with the trainer's unquantized, adapter-free "
                         "computation: drop --quantization / --enable-lora" + (
                             " (an FP8 checkpoint: add --dequantize-checkpoint)"
                             if quantization and not args.quantization else ""))
    if args.decode_gemm == "stream" and (quantization or args.enable_lora or args.true_on_policy):
        raise ValueError("--decode-gemm stream runs the 16-bit projections of an unquantized "
                         "model without adapters, and --true-on-policy needs the trainer's GEMMs: "
                         "drop --quantization / --enable-lora / --true-on-policy, or use "
                         "--decode-gemm auto (which then keeps cuBLAS) or cublas")
    check_speculative(args)
    specs = args.lora_paths.split(",") if args.lora_paths else []
    bad = [p for p in specs if "=" not in p or not p.split("=", 1)[0]]
    if bad:
        raise ValueError(f"--lora-paths {bad}: give each adapter as NAME=PATH")
    model_max = model_max_positions(args.model_path)
    if args.context_length is not None and model_max is not None and args.context_length > model_max:
        raise ValueError(
            f"--context-length {args.context_length} exceeds the model's max_position_embeddings "
            f"({model_max}) in {args.model_path / 'config.json'}; pass --context-length <= {model_max}"
        )
