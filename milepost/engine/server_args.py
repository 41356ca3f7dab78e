"""Launch settings of the embedded engine server (`milepost serve`).

Names follow SGLang's launch flags so a recipe can switch `engine.backend` between SGLang and
ours without renaming. Deviations: no hub names (model and tokenizer are local directories) and
`--cpu-kv-cache-gb`, which sizes the KV pool on CPU where SGLang has no CPU path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from milepost.engine.server_args_checks import check_combinations
from milepost.engine.server_args_resolve import kv_pool_tokens, resolve

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]


class ServerArgs(BaseModel):
    """Validated at construction; call `resolved()` at start to turn every "auto" into a value."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: Path = Field(
        description="Hugging Face model directory (config.json + safetensors) to serve.",
        json_schema_extra={"flags": ["--model"]},
    )
    tokenizer_path: Path | None = Field(
        None, description="Directory of the tokenizer; defaults to --model-path."
    )
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(30000, description="Port the HTTP server listens on.")
    api_key: str | None = Field(
        None, description="Require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(SGLang's flag; milepost/auth.py). Without it, bind only 127.0.0.1.")
    dtype: Dtype = Field(
        "auto", description="Weight and activation dtype; auto = float32 on CPU, bfloat16 on CUDA."
    )
    device: Device = Field("auto", description="Device to run on; auto = cuda when available, else cpu.")
    mem_fraction_static: float = Field(
        0.85,
        description="On CUDA, fraction of the device's total memory that weights plus the KV pool "
        "may take (SGLang's meaning); the KV pool gets what is free after loading the weights "
        "minus (1 - fraction) * total.",
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "float32", "fp8_e4m3"] = Field(
        "auto", description="dtype of the KV pool; auto = the model's --dtype (bfloat16 on CUDA). "
        "fp8_e4m3: float8_e4m3fn entries (scale 1, saturating at +-448, as SGLang without "
        "checkpoint scales): twice the tokens of bf16 in the same memory (docs/low_precision.md)."
    )
    quantization: Literal["fp8", "fp8_block", "mxfp8", "nvfp4", "int4"] | None = Field(
        None, description="fp8 = store the projection weights (q/k/v/o, gate/up/down) as "
        "float8_e4m3fn with one scale per output row, quantized at load and on every weight "
        "update; activations stay in --dtype (milepost/engine/weight_fp8.py). fp8_block (128x128 "
        "weight tiles, 1x128 activation blocks), mxfp8, nvfp4: weights and activations in that "
        "format, each HF tensor quantized on arrival by the trainer's quantizer (docs/low_precision.md); "
        "fp8_block also stores MoE experts in FP8 (128x128 weight tiles, activations in --dtype; "
        "the trainer keeps experts bf16). int4: weights only, groups of 128 (the INT4 QAT recipe). "
        "Unset on an FP8 blockwise checkpoint (config.json quantization_config): fp8_block, served "
        "from the checkpoint's own float8 weights and scales."
    )
    precision_override: str | None = Field(
        None, description="With --quantization fp8_block|mxfp8|nvfp4: PATTERN=bf16[,...] keeps the "
        "tensors whose HF name matches the glob PATTERN (or layers.A-B) unquantized; the trainer "
        "passes its own --precision-override so both sides agree.")
    nvfp4_four_over_six: bool = Field(
        False, description="--quantization nvfp4: scale each block to 4 or 6, whichever quantizes "
        "it with less error (four-over-six); must match the trainer's setting.")
    fp8_activation_scheme: Literal["dynamic", "static"] = Field(
        "dynamic", description="--quantization fp8_block: dynamic = each 1x128 activation block "
        "scaled by its own amax; static = one float32 scale per linear's input, `<module>.input_scale`, "
        "read from the checkpoint and sent with every weight update (a trainer under --fp8-scaling "
        "delayed sends its own; until one arrives a linear scales dynamically).")
    fp8_w8a8_experts: bool = Field(
        False, description="--quantization fp8_block: the MoE experts quantize their inputs per "
        "1x128 block too (W8A8, as the dense projections do and as SGLang serves block-FP8 MoE "
        "checkpoints) instead of keeping them in --dtype (W8A16). On an H200 the 30B-A3B experts "
        "ran x1.47 faster than bf16 at 256 tokens against W8A16's x1.12 (docs/low_precision.md); "
        "the rollout differs more from a bf16 trainer's forward.")
    dequantize_checkpoint: bool = Field(
        False, description="A quantized checkpoint (config.json quantization_config: FP8 blockwise, "
        "per-tensor or per-channel, INT4 pack-quantized) is served from its own values and scales "
        "by the store that holds them (fp8_block, fp8 or int4) unless this is set: then its "
        "weights are dequantized at load (values times their scales) and served in --dtype. The "
        "trainer's launcher sets it when the engines serve bf16.")
    fp8_weight_only: bool = Field(
        False, description="A compressed-tensors FP8-dynamic checkpoint (per-channel FP8 weights, "
        "dynamic per-token FP8 activations) is served W8A8 as it means: each linear's input "
        "quantized per token (one float32 scale per row = amax / 448). Set this to keep the "
        "activations in --dtype (W8A16, the weights still as stored). Needs the fp8 row store "
        "(such a checkpoint, or --quantization fp8, which is weight-only anyway).")
    max_total_tokens: int | None = Field(
        None,
        description="KV pool size in tokens; default derived from --mem-fraction-static on CUDA "
        "and from --cpu-kv-cache-gb on CPU.",
    )
    cpu_kv_cache_gb: float = Field(
        1.0, description="On CPU, GiB of memory for the KV pool when --max-total-tokens is not given."
    )
    page_size: int = Field(16, description="Tokens per KV cache block.")
    context_length: int | None = Field(
        None,
        description="Longest sequence (prompt + output) served; default and upper bound: the "
        "model's max_position_embeddings.",
    )
    chunked_prefill_size: int | None = Field(
        None, description="Most prefill tokens per engine step; default 8192 on CUDA (measured best, benchmarks/RESULTS.md), 512 on CPU."
    )
    max_running_requests: int = Field(256, description="Most requests decoding at once.")
    disable_radix_cache: bool = Field(False, description="Turn off prefix reuse across requests.")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="Paged attention kernels: triton (GPU kernels), torch (reference, any device); "
        "auto = triton on CUDA, torch on CPU.",
    )
    disable_cuda_graph: bool = Field(
        False, description="Run decode steps eagerly instead of replaying captured CUDA graphs."
    )
    decode_gemm: Literal["cublas", "stream", "auto"] = Field(
        "cublas", description="CUDA, 16-bit projections at decode batch sizes (<= 256 rows): "
        "cublas (F.linear); stream = the stream-K GEMM (one wave of persistent programs, each "
        "reading an equal share of the weight; docs/engine_speed.md); auto = whichever of the two "
        "was faster per weight shape and batch bucket, timed on the model's weights at start "
        "(cuBLAS throughout for a quantized model, LoRA or --true-on-policy, which stream refuses). "
        "Values differ from cuBLAS's by the order of fp32 sums only.")
    skip_kernel_warmup: bool = Field(
        False, description="Start serving without first running one prefill of each step size "
        "(CUDA: compiles the kernels whose tiles depend on the token count at start instead of "
        "while serving; takes seconds)."
    )
    cuda_graph_max_bs: int | None = Field(
        None,
        description="Largest decode batch captured in a CUDA graph (larger batches run eagerly); "
        "default --max-running-requests, times --speculative-num-draft-tokens under NGRAM or "
        "STANDALONE speculation (their verify steps replay the graphs, k + 1 rows a request).",
    )
    overlap_schedule: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Launch each decode step before reading back the previous one's tokens, so "
        "host work overlaps GPU work (SGLang's overlap scheduler; off = its "
        "--disable-overlap-schedule); auto = on for CUDA, off on CPU. With speculative decoding "
        "only NGRAM takes it (auto: on for CUDA), for the steps it rests after proposing nothing.",
    )
    sampling_backend: Literal["auto", "pytorch", "triton"] = Field(
        "auto",
        description="Sampler for batches that ask only for a temperature (no top-k/top-p/min-p, "
        "penalties, grammar or extra log-probs): triton = one fused read of the logits "
        "(inverse-CDF sampling with 53-bit uniforms and fp64 picks, exact distribution; other "
        "draws than pytorch's for the same seed), "
        "pytorch = the batched torch sampler for everything; auto = triton on CUDA unless "
        "--true-on-policy.",
    )
    model_impl: Literal["auto", "native", "transformers"] = Field(
        "auto",
        description="Model code: native (milepost's own definitions, fastest), transformers (any "
        "causal LM through transformers' modules, exact but slower; docs/models.md); auto = "
        "native when the architecture and its config have a native path, else transformers.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow a checkpoint with custom modeling code (auto_map in config.json) "
        "to run its own Python code; refused without it."
    )
    max_request_batch: int = Field(
        4096, description="Most sequences (prompts x n) one /generate or /v1 request may ask for; "
        "more is answered 413.")
    max_request_body_mb: float = Field(
        128.0, description="Largest body, in MiB, of a generation request (/generate, /v1/*, "
        "/tokenize); larger is answered 413 unread. Weight updates are not limited.")
    incremental_streaming_output: bool = Field(
        False, description="Streamed chunks carry only the text, ids and log-probs new since the "
        "previous chunk (SGLang's flag); default: everything so far.")
    tool_call_parser: str | None = Field(
        None, description="Model family whose parsers read /v1/chat/completions answers "
        "(tool_calls, reasoning_content): a session family (qwen3, qwen2.5, llama3, deepseek-v3, "
        "kimi-k2, mistral, glm4, gpt-oss, chatml) or SGLang's parser name (qwen25, deepseekv3, "
        "kimi_k2, glm45, ...); without it a request with tools is refused.")
    enable_lora: bool = Field(
        False, description="Serve LoRA adapters beside the base (requests pick one with lora_path; "
        "/load_lora_adapter, /unload_lora_adapter; docs/lora.md). CPU: per-adapter segments; CUDA: "
        "stacked matmuls, decode CUDA graphs kept.")
    max_lora_rank: int = Field(16, ge=1, description="--enable-lora: the largest adapter rank served.")
    lora_target_modules: str = Field(
        "all-linear", description="--enable-lora: projections adapters may target, comma-separated "
        "(q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj) or all-linear.")
    max_loras_per_batch: int = Field(
        8, ge=1, description="--enable-lora: adapters resident at once (each a slot of every "
        "targeted projection's adapter tensors), all usable in one batch.")
    lora_paths: str | None = Field(
        None, description="--enable-lora: adapters to load at start, NAME=PATH[,NAME=PATH...], each "
        "PATH a PEFT adapter directory.")
    true_on_policy: bool = Field(
        False, description="Re-score every finished sequence with the trainer's computation "
        "(milepost/onpolicy/contract.py) and report those log-probs: bitwise equal to a trainer run "
        "with --true-on-policy (docs/true_on_policy.md). Dense Qwen3 / Llama; no fp8, no LoRA.")
    speculative_algorithm: Literal["NGRAM", "STANDALONE", "NEXTN", "EAGLE"] | None = Field(
        None, description="Speculative decoding, exact for RL (docs/speculative.md): NGRAM proposes "
        "what followed the sequence's tail earlier in the prompt and output; STANDALONE runs the small "
        "draft model --speculative-draft-model-path; NEXTN (EAGLE: the same, as SGLang maps it) runs "
        "the checkpoint's own multi-token-prediction layer. The target verifies the proposals in one "
        "forward with the rejection-sampling rule, so tokens and log-probs follow the target exactly.")
    speculative_draft_model_path: Path | None = Field(
        None, description="STANDALONE: Hugging Face directory of the draft model (same vocabulary as "
        "the target, else refused at start).",
        json_schema_extra={"flags": ["--speculative-draft"]})
    speculative_num_draft_tokens: int = Field(
        4, ge=2, description="Tokens the target verifies per request and step, the last sampled "
        "one included (SGLang's count): num_draft_tokens - 1 are proposed.")
    speculative_num_steps: int | None = Field(
        None, ge=1, description="NEXTN / EAGLE: draft steps per verify (SGLang's name); with "
        "--speculative-eagle-topk 1 the tokens verified are num_steps + 1 (--speculative-num-draft-"
        "tokens then defaults to that, and is refused when it differs).")
    speculative_eagle_topk: int | None = Field(
        None, ge=1, description="NEXTN / EAGLE: draft tokens per step (SGLang's name); only 1, a "
        "chain, is implemented (a tree of proposals is refused).")
    speculative_ngram_min_match_window_size: int = Field(
        2, ge=1, description="NGRAM: shortest tail of the sequence matched against its earlier tokens.")
    speculative_ngram_max_match_window_size: int = Field(
        8, ge=1, description="NGRAM: longest tail matched (the longest match wins).")
    speculative_ngram_scope: Literal["request", "prompt", "engine"] = Field(
        "prompt", description="NGRAM: which texts proposals come from: request = the request's own "
        "prompt and output; prompt = also every request with the same prompt, in flight or finished "
        "recently (a GRPO group's samples, the prompt's earlier rollouts); engine = every request "
        "the engine saw recently. Proposals stay exact whatever their source; a weight update keeps "
        "the texts (docs/speculative.md).")
    speculative_ngram_measured_rest: bool = Field(
        True, description="NGRAM with the overlap schedule: also rest from proposing (plain decode "
        "steps, launched ahead) while speculative steps are measured to emit fewer tokens a second "
        "than the plain steps between them, probing again after 1, 2, 4 .. 16 steps "
        "(docs/speculative.md); off: rest only after steps that proposed nothing.")
    speculative_ngram_capacity: int = Field(
        1 << 18, ge=1, description="NGRAM: most tokens the shared n-gram store indexes (scope prompt "
        "or engine) or keeps of finished requests for their conversations' next turns (scope "
        "request); about 1 KB of host memory each at the default window 2-8, so ~260 MB. The "
        "oldest sequences are dropped first (the newest one is kept whole even past it).")
    random_seed: int = Field(0, description="Seed of the sampler's random generator.")
    weight_version: str = Field(
        "default", description="Weight version reported before the first weight update."
    )
    log_level: LogLevel = Field("info", description="Logging level of the server process.")

    @field_validator("model_path")
    @classmethod
    def _model_dir(cls, v: Path) -> Path:
        if not v.is_dir():
            raise ValueError(
                f"--model-path {v} is not a directory; pass a local Hugging Face model directory "
                "(this machine has no hub access)"
            )
        if not (v / "config.json").is_file():
            raise ValueError(
                f"--model-path {v} has no config.json; pass the directory that save_pretrained wrote"
            )
        return v

    @field_validator("tokenizer_path")
    @classmethod
    def _tokenizer_dir(cls, v: Path | None) -> Path | None:
        if v is not None and not v.is_dir():
            raise ValueError(f"--tokenizer-path {v} is not a directory; pass a local tokenizer directory")
        return v

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("--host must not be empty; use 127.0.0.1 (default), or an address "
                             "other hosts reach together with --api-key")
        return v

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 1 <= v <= 65535:
            raise ValueError(f"--port must be in [1, 65535]; got {v}")
        return v

    @field_validator("mem_fraction_static")
    @classmethod
    def _mem_fraction(cls, v: float) -> float:
        if not 0.0 < v < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1); got {v}")
        return v

    @field_validator("cpu_kv_cache_gb")
    @classmethod
    def _cpu_kv(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"--cpu-kv-cache-gb must be > 0; got {v}")
        return v

    @field_validator(
        "max_total_tokens", "page_size", "context_length", "chunked_prefill_size", "max_running_requests",
        "cuda_graph_max_bs", "max_request_batch",
    )
    @classmethod
    def _positive(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v < 1:
            flag = "--" + str(info.field_name).replace("_", "-")
            raise ValueError(f"{flag} must be >= 1; got {v}")
        return v

    @field_validator("max_request_body_mb")
    @classmethod
    def _body_mb(cls, v: float) -> float:
        if not v > 0 or v != v or v == float("inf"):
            raise ValueError(f"--max-request-body-mb must be a positive number; got {v}")
        return v

    @field_validator("random_seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        if not 0 <= v < 2**63:  # torch generators take a non-negative 64-bit seed
            raise ValueError(f"--random-seed must be in [0, 2**63); got {v}")
        return v

    @field_validator("weight_version")
    @classmethod
    def _version(cls, v: str) -> str:
        if not v:
            raise ValueError("--weight-version must not be empty; the default is 'default'")
        return v

    @field_validator("tool_call_parser")
    @classmethod
    def _tool_call_parser(cls, v: str | None) -> str | None:
        from milepost.engine.openai_chat import tool_call_family

        tool_call_family(v)  # an unknown name is refused at start, naming the choices
        return v

    @model_validator(mode="after")
    def _combinations(self) -> ServerArgs:
        check_combinations(self)  # server_args_checks.py: settings valid alone, not together
        return self

    def verified_tokens(self) -> int:
        """Tokens verified per request and step: --speculative-num-draft-tokens, or
        --speculative-num-steps + 1 when only that is given (SGLang's EAGLE count with top-k 1)."""
        if self.speculative_num_steps is not None and "speculative_num_draft_tokens" not in self.model_fields_set:
            return self.speculative_num_steps + 1
        return self.speculative_num_draft_tokens

    def decode_graph_rows(self) -> int:
        """The largest decode batch captured in a CUDA graph: --cuda-graph-max-bs, else every
        running request, times the tokens verified per request under the speculation whose
        verify steps replay the graphs (NGRAM, STANDALONE; docs/speculative.md#cuda)."""
        if self.cuda_graph_max_bs:
            return self.cuda_graph_max_bs
        verifies = self.speculative_algorithm in ("NGRAM", "STANDALONE")
        return self.max_running_requests * (self.verified_tokens() if verifies else 1)

    def resolved(self) -> ServerArgs:
        """A copy where device, dtype, tokenizer path, context length and prefill chunk are concrete
        (server_args_resolve.resolve); call it in the server process at start, not at import."""
        return resolve(self)

    def kv_pool_tokens(self, kv_bytes_per_token: int, cuda_kv_budget_bytes: int | None = None) -> int:
        """KV pool size in tokens, a whole number of pages (server_args_resolve.kv_pool_tokens)."""
        return kv_pool_tokens(self, kv_bytes_per_token, cuda_kv_budget_bytes)

    def torch_dtype(self) -> Any:
        """The torch dtype of a resolved `dtype` (returned as `torch.dtype`)."""
        import torch

        if self.dtype == "auto":
            raise ValueError("dtype is still 'auto'; call resolved() first")
        return getattr(torch, self.dtype)
