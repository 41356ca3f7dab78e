"""Settings of `milepost bench engine` (flags generated from this model, validated at start)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Shape = Literal["qwen3-0.6b", "qwen3-4b", "qwen3-30b-a3b", "tiny"]
SCENARIOS = ("fixed", "mixed", "multiturn", "prefill")

# Peak memory bandwidth (bytes/s) of devices the bound is computed for, matched on the name.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}


class BenchArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path | None = Field(None, description="Hugging Face model directory to benchmark.")
    shape: Shape | None = Field(
        None, description="Instead of --model: a real architecture shape with random weights built "
        "in memory (qwen3-0.6b, qwen3-4b, qwen3-30b-a3b) or a tiny Qwen3 for CPU runs.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV dtype; auto = bfloat16 on CUDA, float32 on CPU.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available.")
    scenarios: str = Field(
        ",".join(SCENARIOS), description="Comma-separated scenarios to run: " + ", ".join(SCENARIOS))
    requests: int = Field(256, description="Requests of the fixed and mixed scenarios.")
    prompt_len: int = Field(128, description="Prompt tokens per request (fixed; first turn of multiturn).")
    output_len: int = Field(256, description="New tokens per request (fixed).")
    mixed_min: int = Field(100, description="Mixed: shortest prompt and output length.")
    mixed_max: int = Field(1024, description="Mixed: longest prompt and output length.")
    sessions: int = Field(32, description="Multiturn: concurrent sessions.")
    turns: int = Field(8, description="Multiturn: turns per session.")
    turn_user_len: int = Field(64, description="Multiturn: tokens of the user message each turn adds.")
    turn_output_len: int = Field(256, description="Multiturn: new tokens per turn.")
    group_size: int = Field(
        1, description="Multiturn: sessions per group sharing one first prompt, as the samples "
        "of one GRPO prompt do (reported as scenario multiturn-gN); 1 = the issue's workload, "
        "every session its own first prompt. Must divide --sessions.")
    prefill_requests: int = Field(256, description="Prefill: requests (one new token each).")
    prefill_len: int = Field(1024, description="Prefill: prompt tokens per request.")
    temperature: float = Field(1.0, description="Sampling temperature of every request (ignore_eos).")
    seed: int = Field(0, description="Seed of prompts, lengths and random weights.")
    hf: bool = Field(True, description="Also run transformers generate (static batches) and print the ratio.")
    hf_batch_size: int | None = Field(
        None, description="Static batch size of transformers generate; default: all requests at once.")
    max_running_requests: int | None = Field(
        None, description="Engine: most requests decoding at once; default: the scenario's requests.")
    mem_fraction_static: float = Field(0.85, description="Engine (CUDA): share of GPU memory for weights + KV.")
    max_total_tokens: int | None = Field(
        None, description="Engine KV pool in tokens; default from --mem-fraction-static on CUDA, "
        "or what the largest scenario needs on CPU.")
    chunked_prefill_size: int | None = Field(None, description="Engine: prefill tokens per step.")
    page_size: int = Field(16, description="Engine: tokens per KV block (the prefix cache shares "
                           "whole blocks and copies the matching part of a last, partial one).")
    overlap_schedule: Literal["auto", "on", "off"] = Field(
        "auto", description="Engine: launch decode steps ahead of reading back the previous "
        "one (see milepost serve --overlap-schedule); auto = on for CUDA.")
    sampling_backend: Literal["auto", "pytorch", "triton"] = Field(
        "auto", description="Engine: sampler for temperature-only batches (see milepost serve "
        "--sampling-backend); auto = triton on CUDA.")
    peak_bandwidth: float | None = Field(
        None, description="Device peak memory bandwidth in bytes/s for the decode bound; default "
        "per known GPU (H200 4.8e12, H100 3.35e12, A100 2.0e12); none on CPU.")
    routed_experts_cost: bool = Field(
        False, description="MoE: run the first scenario again with the engine's routed-expert "
        "record off (same run) and report the cost of recording.")
    speculative: str | None = Field(
        None, description="Also run every scenario with speculative decoding in the same run and "
        "report its speed-up and acceptance length: ngram (--speculative-algorithm NGRAM), "
        "draft:DIR (STANDALONE with the draft model in DIR, same vocabulary) or nextn (NEXTN: the "
        "--model checkpoint's own multi-token-prediction layer).")
    speculative_num_draft_tokens: int = Field(
        4, ge=2, description="--speculative: tokens verified per request and step, the last "
        "sampled one included (milepost serve --speculative-num-draft-tokens).")
    speculative_ngram_measured_rest: bool = Field(
        True, description="--speculative ngram: rest from proposing while speculating measures "
        "slower than plain steps (milepost serve --speculative-ngram-measured-rest).")
    speculative_ngram_scope: str = Field(
        "request,prompt,engine", description="--speculative ngram: comma-separated n-gram scopes "
        "(milepost serve --speculative-ngram-scope), each run over every scenario in this run.")
    n_samples_per_prompt: int = Field(
        1, description="Fixed: requests per distinct prompt, submitted together as a GRPO group's "
        "samples are (reported as scenario fixed-nN); must divide --requests.")
    quantization: Literal["fp8", "fp8_block", "mxfp8", "nvfp4", "int4"] | None = Field(
        None, description="Engine: weight storage format (milepost serve --quantization; "
        "docs/low_precision.md). Compare with a run without it.")
    decode_gemm: Literal["cublas", "stream", "auto"] = Field(
        "cublas", description="Engine: 16-bit projections at decode batch sizes (see milepost "
        "serve --decode-gemm).")
    fp8_w8a8_experts: bool = Field(
        False, description="Engine, with --quantization fp8_block: MoE experts W8A8 (milepost serve "
        "--fp8-w8a8-experts).")
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto", description="Engine: KV pool dtype; fp8_e4m3 = float8 entries (twice bf16's tokens).")
    timeline: bool = Field(
        False, description="Also print where each timed scenario's wall time went: steps and "
        "seconds per kind (prefill, mixed, decode), gaps, and the inter-token latency running "
        "decodes saw (percentiles over decode rows).")
    skip_kernel_warmup: bool = Field(
        False, description="Engine: no prefill of each step size at start (milepost serve "
        "--skip-kernel-warmup); the bench's own warm-up run still goes first. Each scenario reports "
        "the Triton kernels compiled inside its timed run.")
    json_out: Path | None = Field(None, description="Also write the results as JSON to this file.")

    @field_validator("requests", "prompt_len", "output_len", "mixed_min", "mixed_max", "sessions",
                     "turns", "turn_user_len", "turn_output_len", "prefill_requests", "prefill_len",
                     "hf_batch_size", "max_running_requests", "max_total_tokens",
                     "chunked_prefill_size", "page_size", "group_size", "n_samples_per_prompt")
    @classmethod
    def _positive(cls, v: int | None, info: object) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"--{info.field_name.replace('_', '-')} must be >= 1; got {v}")
        return v

    @field_validator("scenarios")
    @classmethod
    def _scenarios(cls, v: str) -> str:
        names = [s.strip() for s in v.split(",") if s.strip()]
        bad = [s for s in names if s not in SCENARIOS]
        if bad or not names:
            raise ValueError(f"--scenarios: unknown {bad or v!r}; choose from {', '.join(SCENARIOS)}")
        return ",".join(names)

    @field_validator("speculative")
    @classmethod
    def _speculative(cls, v: str | None) -> str | None:
        if v is None or v in ("ngram", "nextn"):
            return v
        if not v.startswith("draft:") or not v.removeprefix("draft:"):
            raise ValueError(f"--speculative {v!r}: use ngram, nextn or draft:DIR")
        path = Path(v.removeprefix("draft:"))
        if not (path / "config.json").is_file():
            raise ValueError(f"--speculative {v!r}: {path} has no config.json; pass a Hugging Face "
                             "directory of the draft model")
        return v

    @field_validator("speculative_ngram_scope")
    @classmethod
    def _scopes(cls, v: str) -> str:
        names = [s.strip() for s in v.split(",") if s.strip()]
        bad = [s for s in names if s not in ("request", "prompt", "engine")]
        if bad or not names:
            raise ValueError(f"--speculative-ngram-scope: unknown {bad or v!r}; choose from "
                             "request, prompt, engine")
        return ",".join(names)

    @model_validator(mode="after")
    def _combinations(self) -> BenchArgs:
        if (self.model is None) == (self.shape is None):
            raise ValueError("give exactly one of --model (a Hugging Face directory) or --shape")
        if self.speculative == "nextn" and self.model is None:
            raise ValueError("--speculative nextn drafts with the checkpoint's own MTP layers: pass "
                             "--model DIR of a checkpoint that has them (--shape has random weights only)")
        if self.model is not None and not (self.model / "config.json").is_file():
            raise ValueError(f"--model {self.model} has no config.json; pass a Hugging Face directory")
        if self.sessions % self.group_size:
            raise ValueError(f"--group-size ({self.group_size}) must divide --sessions "
                             f"({self.sessions})")
        if self.requests % self.n_samples_per_prompt:
            raise ValueError(f"--n-samples-per-prompt ({self.n_samples_per_prompt}) must divide "
                             f"--requests ({self.requests})")
        if self.mixed_min > self.mixed_max:
            raise ValueError(f"--mixed-min ({self.mixed_min}) exceeds --mixed-max ({self.mixed_max})")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1); got {self.mem_fraction_static}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0; got {self.temperature}")
        if self.quantization and self.hf:
            raise ValueError(f"--quantization {self.quantization} converts the benchmark's model "
                             "in place; the transformers side would get those weights: add --no-hf")
        return self

    @property
    def scenario_list(self) -> list[str]:
        return self.scenarios.split(",")
