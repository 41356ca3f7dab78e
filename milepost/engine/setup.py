"""Builds a ready engine from resolved ServerArgs: model, tokenizer, KV pool sized to its budget."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from milepost.engine.engine import Engine, EngineConfig
from milepost.engine.kv_budget import cuda_kv_budget_bytes, out_of_memory_message
from milepost.engine.runner import ModelRunner
from milepost.engine.server import ServerInfo
from milepost.engine.server_args import ServerArgs
from milepost.engine.speculative_setup import (
    draft_kv_bytes_per_token,
    load_draft,
    make_speculator,
    mtp_kv_bytes_per_token,
)
from milepost.models.attention import PagedKVCache
from milepost.models.base import CausalLM
from milepost.models.masked_attention import needs_variant_backend
from milepost.models.registry import load_model

log = logging.getLogger(__name__)
_LAYERWISE = ("fp8_block", "mxfp8", "nvfp4", "int4")  # quantized per HF tensor (lowprec/engine_store.py)


def load_tokenizer(path: Path) -> object | None:
    """The checkpoint's tokenizer, or None when the directory has none (input_ids only then)."""
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        log.warning("no tokenizer in %s: the server accepts input_ids only", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_engine(
    args: ServerArgs, model: CausalLM | None = None, record_routed_experts: bool = True
) -> tuple[Engine, ServerInfo, object | None]:
    """args must be resolved (no "auto" left).

    `model`: an already built model on the device (benchmarks with random weights) instead of
    loading args.model_path's weights; `record_routed_experts=False` skips the per-slot record
    of MoE routing (benchmarks of its cost).
    """
    device = torch.device(args.device)
    dtype = args.torch_dtype()
    if device.type == "cuda":
        if device.index is None:  # "cuda" means the current device; pin it so allocations agree
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    # Loaded, fused and stored layer by layer (lowprec/engine_load.py), a quantized checkpoint's
    # values as stored where its store holds them; a model handed in is stored whole, below.
    layerwise = model is None and args.quantization is not None
    if model is None:
        try:
            if layerwise:
                from milepost.lowprec.engine_load import load_quantized

                model = load_quantized(args, dtype, device)
            else:
                model = load_model(args.model_path, dtype, device, backend=args.model_impl,
                                   trust_remote_code=args.trust_remote_code)
        except torch.OutOfMemoryError as e:
            raise RuntimeError(out_of_memory_message("the weights", None, args.mem_fraction_static)) from e
    if args.true_on_policy:  # refused before any request: no profile, no bitwise promise
        from milepost.onpolicy.profiles import profile_refusals

        arch = type(model).__name__ if getattr(model, "native", True) else "a transformers-fallback model"
        why = profile_refusals(arch, moe=model.moe_top_k > 0, device=device.type, dtype=args.dtype)
        if why:
            raise ValueError("; ".join(why))
    fuse = getattr(model, "fuse_projections", None)
    # one GEMM for q/k/v and one for gate/up; HF names still address slices. Not under
    # --true-on-policy: the re-score must run the trainer's separate projections. (A layerwise
    # load fused each layer as it came.)
    if fuse is not None and not args.true_on_policy and not layerwise:
        fuse()
    native = getattr(model, "native", True)
    if args.quantization and not native:
        raise ValueError(f"--quantization {args.quantization} needs a native model; this one runs "
                         "on the transformers fallback (docs/models.md): drop --quantization")
    if args.quantization in _LAYERWISE and not layerwise:  # per HF tensor, after fusing
        from milepost.lowprec.engine_setup import store_engine_precision

        store_engine_precision(model, args, device)
    if args.quantization == "fp8" and not layerwise:  # after fusing: one scale per row of the fused weights too
        from milepost.engine.weight_fp8 import store_fp8

        store_fp8(model)
    cfg = model.hf_config
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else getattr(torch, args.kv_cache_dtype)
    elem = torch.empty((), dtype=kv_dtype).element_size()
    kv_values = getattr(model, "kv_values", True)  # False: MLA's latent lives in K pools alone
    kv_bytes_per_token = (2 if kv_values else 1) * model.num_layers * model.num_kv_heads * model.head_dim * elem
    if model.moe_top_k > 0 and record_routed_experts:  # the routed-expert record beside the KV
        kv_bytes_per_token += model.num_layers * model.moe_top_k * 4
    draft = load_draft(args, dtype, device)  # --speculative-algorithm STANDALONE: its KV shares blocks
    kv_bytes_per_token += draft_kv_bytes_per_token(draft, kv_dtype) + mtp_kv_bytes_per_token(args, model, kv_dtype)
    budget = None
    if device.type == "cuda":  # SGLang's meaning: weights + KV <= fraction of the total (kv_budget.py)
        # buffers too: quantized engines keep their weights' scales (fp8, int4) as buffers
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        # An engine closed earlier in this process (a benchmark's previous run, a test) leaves its
        # pool to the garbage collector and then in torch's cache, where the driver counts it as
        # used: collect and return it first, or this engine would size its pool from the remainder.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_kv_budget_bytes(total, free, args.mem_fraction_static, weights)
    tokens = args.kv_pool_tokens(kv_bytes_per_token, budget)
    try:
        kv = PagedKVCache(model.num_layers, tokens // args.page_size, args.page_size,
                          model.num_kv_heads, model.head_dim, kv_dtype, device, values=kv_values)
    except torch.OutOfMemoryError as e:
        raise RuntimeError(out_of_memory_message(
            f"the KV pool of {tokens} tokens", tokens * kv_bytes_per_token, args.mem_fraction_static,
        )) from e
    log.info("KV pool: %d tokens in %d blocks of %d (%.1f MiB)", tokens, kv.num_blocks,
             args.page_size, kv.nbytes() / 2**20)

    tokenizer = load_tokenizer(Path(args.tokenizer_path or args.model_path))
    eos = getattr(cfg, "eos_token_id", None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos_ids = sorted({*eos_ids, tokenizer.eos_token_id})
    context_length = args.context_length or cfg.max_position_embeddings
    graph_bs = 0 if args.disable_cuda_graph or device.type != "cuda" else args.decode_graph_rows()
    if graph_bs and needs_variant_backend(model):  # per-sequence torch attention (host syncs)
        log.warning("decode CUDA graphs are off: %s", "the model runs on the transformers fallback"
                    if not native else "sliding-window layers run on torch attention")
        graph_bs = 0
    if graph_bs and model.moe_top_k > 0 and dtype != torch.bfloat16:
        # Only the bf16 grouped-GEMM experts avoid host syncs; the per-expert loop cannot be captured.
        log.warning("decode CUDA graphs are off: MoE experts are graph-safe only in bfloat16 (dtype %s)",
                    args.dtype)
        graph_bs = 0
    runner = ModelRunner(model, kv, device, attention_backend=args.attention_backend,
                         cuda_graph_max_bs=graph_bs, context_length=context_length,
                         record_routed_experts=record_routed_experts)
    if args.enable_lora:
        from milepost.lora.routes import start_adapter_pool

        runner.lora = start_adapter_pool(model, args, device, dtype)
    if args.decode_gemm != "cublas":
        from milepost.engine.decode_gemm import applies, use_stream_linears

        if applies(args):
            use_stream_linears(model, args.decode_gemm, device)
    runner.capture_cuda_graphs()
    engine = Engine(
        runner,
        tokenizer,
        EngineConfig(
            block_size=args.page_size, num_blocks=kv.num_blocks,
            chunked_prefill_size=args.chunked_prefill_size or 512,
            max_running_requests=args.max_running_requests, context_length=context_length,
            enable_prefix_cache=not args.disable_radix_cache,
            weight_version=args.weight_version, random_seed=args.random_seed,
            overlap_schedule=args.overlap_schedule == "on", true_on_policy=args.true_on_policy,
            fused_sampler=args.sampling_backend == "triton",
        ),
    )
    engine.speculator = make_speculator(
        args, model, draft, kv.num_blocks, kv_dtype, device, context_length=context_length,
        cuda_graph_max_bs=runner.graphs.max_bs if runner.graphs is not None else 0)
    mtp = getattr(engine.speculator, "drafter", None)
    if hasattr(mtp, "observe"):  # NEXTN: the MTP layer reads the target's hidden states, shares blocks
        runner.keep_hidden = True
        runner.shadow_pools = [*mtp.kv.k, *mtp.kv.v]
    info = ServerInfo(
        model_path=str(args.model_path),
        tokenizer_path=str(args.tokenizer_path or args.model_path) if tokenizer else None,
        context_length=context_length, vocab_size=model.vocab_size, eos_token_ids=eos_ids,
        server_args=args.model_dump(mode="json") | {"max_total_tokens": tokens},
    )
    return engine, info, tokenizer
