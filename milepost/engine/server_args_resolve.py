"""What `ServerArgs` derives at start: every "auto" made concrete, and the KV pool's size.

Reads CUDA availability and the model directory's config.json, so it runs in the server process
at start (`ServerArgs.resolved()`), not when flags are parsed. The config.json readers live here
too: the model validator refuses custom code and a context length past the model's with them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from milepost.engine.server_args_precision import checkpoint_precision

if TYPE_CHECKING:
    from milepost.engine.server_args import ServerArgs

_GIB = 1 << 30


def resolve(args: ServerArgs) -> ServerArgs:
    """A copy where device, dtype, tokenizer path, context length and prefill chunk are concrete.

    Reads CUDA availability, so call it in the server process at start, not at import.
    `max_total_tokens` stays None unless given: only the engine knows its KV bytes per token
    (see `kv_pool_tokens`).
    """
    import torch  # deferred: parsing flags should not pay for importing torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available; use --device cpu or auto")
    if device == "cuda" and args.attention_backend == "torch" and not args.disable_cuda_graph:
        raise ValueError(
            "--attention-backend torch (the reference path) cannot be captured in CUDA graphs; "
            "add --disable-cuda-graph or use --attention-backend auto/triton"
        )
    if device == "cpu" and args.sampling_backend == "triton":
        raise ValueError("--sampling-backend triton runs a GPU kernel but the device is cpu; "
                         "use --sampling-backend auto or pytorch on CPU")
    if args.true_on_policy and args.sampling_backend == "triton":
        raise ValueError("--true-on-policy needs the engine's log-probs computed as the trainer's; "
                         "the fused sampler sums in another order: use --sampling-backend auto "
                         "or pytorch")
    if device == "cpu" and args.attention_backend == "triton":
        raise ValueError(
            "--attention-backend triton runs GPU kernels but the device is cpu; "
            "use --attention-backend auto or torch on CPU"
        )
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    kv_cache_dtype = dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    context_length = args.context_length or model_max_positions(args.model_path)
    if context_length is None:
        raise ValueError(
            f"{args.model_path / 'config.json'} has no max_position_embeddings; pass --context-length"
        )
    chunk = args.chunked_prefill_size or (8192 if device == "cuda" else 512)
    return args.model_copy(
        update={
            "device": device,
            "dtype": dtype,
            "kv_cache_dtype": kv_cache_dtype,
            "tokenizer_path": args.tokenizer_path or args.model_path,
            "context_length": context_length,
            "chunked_prefill_size": chunk,
            "sampling_backend": args.sampling_backend if args.sampling_backend != "auto"
            else ("triton" if device == "cuda" and not args.true_on_policy else "pytorch"),
            "overlap_schedule": args.overlap_schedule if args.overlap_schedule != "auto"
            else ("on" if device == "cuda" and args.speculative_algorithm in (None, "NGRAM")
                  else "off"),
            **checkpoint_precision(args),
        }
    )


def kv_pool_tokens(args: ServerArgs, kv_bytes_per_token: int,
                   cuda_kv_budget_bytes: int | None = None) -> int:
    """KV pool size in tokens, a whole number of pages.

    `kv_bytes_per_token` is the bytes one token takes over all layers (K and V). On CUDA the
    caller passes `cuda_kv_budget_bytes` from kv_budget.cuda_kv_budget_bytes (free memory after
    the weights minus (1 - --mem-fraction-static) * total); on CPU the budget is
    --cpu-kv-cache-gb. --max-total-tokens wins.
    """
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    else:
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1; got {kv_bytes_per_token}")
        if args.device == "auto":
            raise ValueError("kv_pool_tokens needs a concrete device; call resolved() first")
        if args.device == "cuda":
            if cuda_kv_budget_bytes is None:
                raise ValueError("kv_pool_tokens on CUDA needs cuda_kv_budget_bytes")
            budget = cuda_kv_budget_bytes
        else:
            budget = int(args.cpu_kv_cache_gb * _GIB)
        tokens = budget // kv_bytes_per_token
    tokens -= tokens % args.page_size
    if tokens < args.page_size:
        hint = "--mem-fraction-static" if args.device == "cuda" else "--cpu-kv-cache-gb"
        raise ValueError(
            f"the KV pool holds {tokens} tokens, less than one page of {args.page_size}; "
            f"raise {hint} or --max-total-tokens"
        )
    return tokens


def has_custom_code(model_path: Path) -> bool:
    """config.json names custom modeling code (auto_map), which runs only when trusted."""
    path = Path(model_path) / "config.json"
    try:
        return path.is_file() and bool(json.loads(path.read_text()).get("auto_map"))
    except json.JSONDecodeError:
        return False  # model_max_positions reports the broken file


def model_max_positions(model_path: Path) -> int | None:
    """`max_position_embeddings` from a model directory's config.json (or its text_config)."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-path: {path} is not valid JSON ({e}); re-save the checkpoint") from e
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int):
            return value
    return None
