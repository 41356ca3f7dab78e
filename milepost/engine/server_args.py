"""Launch settings of the embedded engine server (`milepost serve`).

Names follow SGLang's launch flags so a recipe can switch `engine.backend` between SGLang and
ours without renaming. Deviations: no hub names (model and tokenizer are local directories) and
`--cpu-kv-cache-gb`, which sizes the KV pool on CPU where SGLang has no CPU path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]

_GIB = 1 << 30


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
    cuda_graph_max_bs: int | None = Field(
        None,
        description="Largest decode batch captured in a CUDA graph (larger batches run eagerly); "
        "default --max-running-requests.",
    )
    overlap_schedule: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Launch each decode step before reading back the previous one's tokens, so "
        "host work overlaps GPU work (SGLang's overlap scheduler; off = its "
        "--disable-overlap-schedule); auto = on for CUDA, off on CPU.",
    )
    sampling_backend: Literal["auto", "pytorch", "triton"] = Field(
        "auto",
        description="Sampler for batches that ask only for a temperature (no top-k/top-p/min-p, "
        "penalties, grammar or extra log-probs): triton = one fused pass over the logits "
        "(Gumbel-max, exact distribution; other draws than pytorch's for the same seed), "
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
    speculative_ngram_capacity: int = Field(
        1 << 18, ge=1, description="NGRAM with scope prompt or engine: most tokens the shared n-gram "
        "store indexes (about 1.2 KB of host memory each at the default window 2-8, so ~320 MB); the "
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
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(
                f"--max-total-tokens ({self.max_total_tokens}) must hold at least one page of "
                f"--page-size ({self.page_size}) tokens; raise --max-total-tokens or lower --page-size"
            )
        if not self.trust_remote_code and has_custom_code(self.model_path):
            raise ValueError(
                f"{self.model_path / 'config.json'} has auto_map: the model runs its own modeling code; "
                "review it, then pass --trust-remote-code"
            )
        if (self.lora_paths or self.max_loras_per_batch != 8 or self.lora_target_modules != "all-linear"
                or self.max_lora_rank != 16) and not self.enable_lora:
            raise ValueError("--lora-paths / --max-lora-rank / --lora-target-modules / "
                             "--max-loras-per-batch need --enable-lora")
        quantization = self._checkpoint_quantization()
        if (self.precision_override or self.nvfp4_four_over_six) and quantization in (None, "fp8"):
            raise ValueError("--precision-override / --nvfp4-four-over-six need --quantization "
                             "fp8_block, mxfp8 or nvfp4")
        if self.fp8_activation_scheme == "static" and quantization != "fp8_block":
            raise ValueError("--fp8-activation-scheme static scales the fp8_block engine's "
                             "activations; add --quantization fp8_block or drop it")
        if self.fp8_weight_only and quantization != "fp8":
            raise ValueError("--fp8-weight-only keeps a per-channel FP8 checkpoint's activations in "
                             f"--dtype; the engine serves {quantization or 'no quantized store'} "
                             "here (it needs an FP8-dynamic checkpoint served as stored, or "
                             "--quantization fp8): drop --fp8-weight-only")
        if self.nvfp4_four_over_six and self.quantization != "nvfp4":
            raise ValueError("--nvfp4-four-over-six needs --quantization nvfp4")
        if self.precision_override:
            from milepost.lowprec.contract import parse_overrides

            parse_overrides(self.precision_override.split(","))
        if self.true_on_policy and (quantization or self.enable_lora):
            raise ValueError("--true-on-policy re-scores with the trainer's unquantized, adapter-free "
                             "computation: drop --quantization / --enable-lora" + (
                                 " (an FP8 checkpoint: add --dequantize-checkpoint)"
                                 if quantization and not self.quantization else ""))
        self._check_speculative()
        specs = self.lora_paths.split(",") if self.lora_paths else []
        bad = [p for p in specs if "=" not in p or not p.split("=", 1)[0]]
        if bad:
            raise ValueError(f"--lora-paths {bad}: give each adapter as NAME=PATH")
        model_max = model_max_positions(self.model_path)
        if self.context_length is not None and model_max is not None and self.context_length > model_max:
            raise ValueError(
                f"--context-length {self.context_length} exceeds the model's max_position_embeddings "
                f"({model_max}) in {self.model_path / 'config.json'}; pass --context-length <= {model_max}"
            )
        return self

    def _check_speculative(self) -> None:
        """Speculative settings need their algorithm, and a draft its own vocabulary's match."""
        algo, draft = self.speculative_algorithm, self.speculative_draft_model_path
        tuned = (self.speculative_num_draft_tokens != 4
                 or self.speculative_ngram_min_match_window_size != 2
                 or self.speculative_ngram_max_match_window_size != 8
                 or self.speculative_ngram_scope != "prompt"
                 or self.speculative_ngram_capacity != 1 << 18)
        eagle = (self.speculative_num_steps, self.speculative_eagle_topk) != (None, None)
        if algo is None and (draft is not None or tuned or eagle):
            raise ValueError("--speculative-draft-model-path / --speculative-num-draft-tokens / "
                             "--speculative-num-steps / --speculative-eagle-topk / --speculative-ngram-* "
                             "need --speculative-algorithm NGRAM, STANDALONE or NEXTN")
        if algo in ("NEXTN", "EAGLE"):
            self._check_nextn()
        elif eagle:
            raise ValueError(f"--speculative-num-steps / --speculative-eagle-topk are NEXTN / EAGLE "
                             f"settings; with --speculative-algorithm {algo} use "
                             "--speculative-num-draft-tokens")
        if algo == "STANDALONE" and draft is None:
            raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path "
                             "DIR (a small model with the target's vocabulary)")
        if algo == "NGRAM" and draft is not None:
            raise ValueError("--speculative-algorithm NGRAM uses no draft model: drop "
                             "--speculative-draft-model-path or use STANDALONE")
        if self.speculative_ngram_min_match_window_size > self.speculative_ngram_max_match_window_size:
            raise ValueError("--speculative-ngram-min-match-window-size exceeds "
                             "--speculative-ngram-max-match-window-size")
        if algo is not None and self.overlap_schedule == "on":
            raise ValueError("--speculative-algorithm needs each step's tokens on the host to propose "
                             "the next ones: drop --overlap-schedule on (auto turns it off)")
        if draft is not None:
            from milepost.engine.speculative_setup import check_draft_dir

            check_draft_dir(self.model_path, draft)

    def verified_tokens(self) -> int:
        """Tokens verified per request and step: --speculative-num-draft-tokens, or
        --speculative-num-steps + 1 when only that is given (SGLang's EAGLE count with top-k 1)."""
        if self.speculative_num_steps is not None and "speculative_num_draft_tokens" not in self.model_fields_set:
            return self.speculative_num_steps + 1
        return self.speculative_num_draft_tokens

    def _check_nextn(self) -> None:
        """NEXTN / EAGLE draft with the target checkpoint's own MTP layers: they must be there."""
        algo = self.speculative_algorithm
        draft = self.speculative_draft_model_path
        if draft is not None and Path(draft).resolve() != Path(self.model_path).resolve():
            raise ValueError(f"--speculative-algorithm {algo} drafts with the target's own multi-token-"
                             "prediction layers; a separate EAGLE head (--speculative-draft-model-path "
                             f"{draft}) is not supported: drop the path, or use STANDALONE for a draft model")
        if self.model_impl == "transformers":
            raise ValueError(f"--speculative-algorithm {algo} runs the native model's MTP layers; "
                             "--model-impl transformers has none: use auto or native")
        if self.speculative_eagle_topk not in (None, 1):
            raise ValueError(f"--speculative-eagle-topk {self.speculative_eagle_topk}: only 1 (a chain of "
                             "proposals) is implemented; pass --speculative-eagle-topk 1")
        steps = self.speculative_num_steps
        if steps is not None and "speculative_num_draft_tokens" in self.model_fields_set:
            if self.speculative_num_draft_tokens != steps + 1:
                raise ValueError(f"--speculative-num-steps {steps} with --speculative-eagle-topk 1 verifies "
                                 f"{steps + 1} tokens, but --speculative-num-draft-tokens is "
                                 f"{self.speculative_num_draft_tokens}: pass {steps + 1} or drop one of them")
        from milepost.engine.speculative_setup import check_mtp_checkpoint

        check_mtp_checkpoint(self.model_path, algo)

    def _checkpoint_quantization(self) -> str | None:
        """--quantization as the checkpoint makes it: a quantized checkpoint (FP8 blockwise or
        per-tensor: fp8_block; FP8 per-channel: fp8; INT4 pack-quantized: int4) is served by the
        store that holds its values as stored unless --dequantize-checkpoint (as SGLang, which
        takes the method from the checkpoint's quantization_config); a layout the engines cannot
        hold is refused here, at start."""
        from milepost.lowprec.quant_checkpoint import checkpoint_quant, unheld_weights

        ckpt = checkpoint_quant(self.model_path)
        if self.dequantize_checkpoint and ckpt is None:
            raise ValueError(f"--dequantize-checkpoint: {self.model_path / 'config.json'} has no "
                             "quantization_config; drop the flag")
        if self.dequantize_checkpoint and self.quantization:
            raise ValueError(f"--dequantize-checkpoint with --quantization {self.quantization}: "
                             "serving the dequantized weights quantized again; drop one (a quantized "
                             "checkpoint without either is served from its own values)")
        if ckpt is None or self.dequantize_checkpoint or self.quantization:
            return self.quantization  # other formats: re-quantized from the dequantized weights
        if ckpt.inexact:
            raise ValueError(ckpt.inexact)
        unheld = unheld_weights(self.model_path, ckpt)
        if unheld:
            more = f" (and {len(unheld) - 1} more)" if len(unheld) > 1 else ""
            raise ValueError(f"{unheld[0]}{more}: a {ckpt.layout} weight that the {ckpt.serve_as} "
                             "store does not hold (it holds the q/k/v/o and gate/up/down projections "
                             "and MoE experts); serve the checkpoint with "
                             "--dequantize-checkpoint")
        return ckpt.serve_as

    def resolved(self) -> ServerArgs:
        """A copy where device, dtype, tokenizer path, context length and prefill chunk are concrete.

        Reads CUDA availability, so call it in the server process at start, not at import.
        `max_total_tokens` stays None unless given: only the engine knows its KV bytes per token
        (see `kv_pool_tokens`).
        """
        import torch  # deferred: parsing flags should not pay for importing torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was given but CUDA is not available; use --device cpu or auto")
        if device == "cuda" and self.attention_backend == "torch" and not self.disable_cuda_graph:
            raise ValueError(
                "--attention-backend torch (the reference path) cannot be captured in CUDA graphs; "
                "add --disable-cuda-graph or use --attention-backend auto/triton"
            )
        if device == "cpu" and self.sampling_backend == "triton":
            raise ValueError("--sampling-backend triton runs a GPU kernel but the device is cpu; "
                             "use --sampling-backend auto or pytorch on CPU")
        if self.true_on_policy and self.sampling_backend == "triton":
            raise ValueError("--true-on-policy needs the engine's log-probs computed as the trainer's; "
                             "the fused sampler sums in another order: use --sampling-backend auto "
                             "or pytorch")
        if device == "cpu" and self.attention_backend == "triton":
            raise ValueError(
                "--attention-backend triton runs GPU kernels but the device is cpu; "
                "use --attention-backend auto or torch on CPU"
            )
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        kv_cache_dtype = dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        context_length = self.context_length or model_max_positions(self.model_path)
        if context_length is None:
            raise ValueError(
                f"{self.model_path / 'config.json'} has no max_position_embeddings; pass --context-length"
            )
        chunk = self.chunked_prefill_size or (8192 if device == "cuda" else 512)
        return self.model_copy(
            update={
                "device": device,
                "dtype": dtype,
                "kv_cache_dtype": kv_cache_dtype,
                "tokenizer_path": self.tokenizer_path or self.model_path,
                "context_length": context_length,
                "chunked_prefill_size": chunk,
                "sampling_backend": self.sampling_backend if self.sampling_backend != "auto"
                else ("triton" if device == "cuda" and not self.true_on_policy else "pytorch"),
                "overlap_schedule": self.overlap_schedule if self.overlap_schedule != "auto"
                else ("on" if device == "cuda" and self.speculative_algorithm is None else "off"),
                **self._checkpoint_precision(),
            }
        )

    def _checkpoint_precision(self) -> dict[str, str]:
        """A quantized checkpoint's settings: its store, and its static input scales
        (`activation_scheme: static`) unless --fp8-activation-scheme was given."""
        from milepost.lowprec.quant_checkpoint import checkpoint_quant

        quantization = self._checkpoint_quantization()
        out = {"quantization": quantization} if quantization != self.quantization else {}
        ckpt = checkpoint_quant(self.model_path)
        if (ckpt is not None and ckpt.activation_scheme == "static" and quantization == "fp8_block"
                and "fp8_activation_scheme" not in self.model_fields_set):
            out["fp8_activation_scheme"] = "static"
        return out

    def kv_pool_tokens(self, kv_bytes_per_token: int, cuda_kv_budget_bytes: int | None = None) -> int:
        """KV pool size in tokens, a whole number of pages.

        `kv_bytes_per_token` is the bytes one token takes over all layers (K and V). On CUDA the
        caller passes `cuda_kv_budget_bytes` from kv_budget.cuda_kv_budget_bytes (free memory after
        the weights minus (1 - --mem-fraction-static) * total); on CPU the budget is
        --cpu-kv-cache-gb. --max-total-tokens wins.
        """
        if self.max_total_tokens is not None:
            tokens = self.max_total_tokens
        else:
            if kv_bytes_per_token < 1:
                raise ValueError(f"kv_bytes_per_token must be >= 1; got {kv_bytes_per_token}")
            if self.device == "auto":
                raise ValueError("kv_pool_tokens needs a concrete device; call resolved() first")
            if self.device == "cuda":
                if cuda_kv_budget_bytes is None:
                    raise ValueError("kv_pool_tokens on CUDA needs cuda_kv_budget_bytes")
                budget = cuda_kv_budget_bytes
            else:
                budget = int(self.cpu_kv_cache_gb * _GIB)
            tokens = budget // kv_bytes_per_token
        tokens -= tokens % self.page_size
        if tokens < self.page_size:
            hint = "--mem-fraction-static" if self.device == "cuda" else "--cpu-kv-cache-gb"
            raise ValueError(
                f"the KV pool holds {tokens} tokens, less than one page of {self.page_size}; "
                f"raise {hint} or --max-total-tokens"
            )
        return tokens

    def torch_dtype(self) -> Any:
        """The torch dtype of a resolved `dtype` (returned as `torch.dtype`)."""
        import torch

        if self.dtype == "auto":
            raise ValueError("dtype is still 'auto'; call resolved() first")
        return getattr(torch, self.dtype)


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
