"""The run's shape: the model, where it runs, memory and the engines."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from milepost.config_tables.base import Table


class ModelTable(Table):
    hf_checkpoint: Path = Field(
        description="Local Hugging Face model directory (config.json + safetensors) to train from; "
        "the engines start from it too."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Weights dtype of trainer and engines; auto = bfloat16 on CUDA, float32 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where trainer and engines run; auto = cuda when available, else cpu."
    )
    seed: int = Field(1234, ge=0, description="Seed of the trainer and of the engines' samplers.")


class PlacementTable(Table):
    colocate: bool = Field(
        False,
        description="Trainer and engines share devices: the trainer is offloaded while the engines "
        "generate, and weights move by in-host handoff (transfer mode tensor).",
    )
    actor_num_gpus_per_node: int = Field(
        1, ge=1, description="Trainer ranks (one process per GPU; on CPU, one process each)."
    )
    rollout_num_engines: int | None = Field(
        None,
        ge=1,
        description="Inference engines; default 1, or the number of --engine-urls with "
        "--engine-backend external.",
    )
    rollout_num_gpus_per_engine: int = Field(
        1, ge=1, description="GPUs per engine (its tensor-parallel size)."
    )
    trainer_cpu_threads: int | None = Field(
        None, ge=1,
        description="On CPU, threads of each trainer rank; default: the host's cores divided "
        "among the ranks (under --fully-async, the engines' threads taken out first).",
    )
    # Scaling out (docs/scaling.md): the same components on a Ray cluster's nodes.
    launcher: Literal["local", "ray"] = Field(
        "local", description="local = processes on this host (loopback); ray = Ray actors on the "
        "cluster at --ray-address, in placement groups, servers on their node's address with a "
        "per-run API key (pip install 'milepost[ray]').")
    ray_address: str = Field(
        "auto", min_length=1, description="--launcher ray: the head's HOST:PORT, or auto (RAY_ADDRESS, "
        "else the cluster started on this node).")
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="--launcher ray: how each placement group (trainer ranks; engines) "
        "spreads its bundles over nodes.")
    ray_cpus_per_component: float = Field(
        1.0, gt=0, description="--launcher ray: CPUs in each trainer rank's and engine's bundle "
        "(on CPU runs also their threads; a colocated pair shares one bundle).")
    ray_trainer_resources: list[str] | None = Field(
        None, description="--launcher ray: custom resources (NAME or NAME=AMOUNT) each trainer "
        "bundle also asks, to steer the ranks onto the nodes that offer them.")
    ray_engine_resources: list[str] | None = Field(
        None, description="--launcher ray: custom resources (NAME or NAME=AMOUNT) each engine "
        "bundle also asks.")
    ray_placement_timeout_s: float = Field(
        120.0, gt=0, description="--launcher ray: how long to wait for the placement groups "
        "before refusing the run (with the nodes' resources).")
    # The training backend (docs/megatron.md); sizes follow Megatron's flags.
    train_backend: Literal["fsdp", "megatron"] = Field(
        "fsdp", description="fsdp = FSDP2 data parallel over Hugging Face models as they are; megatron = "
        "megatron-core with tensor / expert parallel sizes (pip install 'milepost[megatron]').")
    tensor_model_parallel_size: int = Field(1, ge=1, description="--train-backend megatron: tensor-parallel size.")
    pipeline_model_parallel_size: int = Field(
        1, ge=1, description="--train-backend megatron: pipeline-parallel size (megatron's 1F1B schedule).")
    context_parallel_size: int = Field(
        1, ge=1, description="--train-backend megatron: context-parallel size (not wired yet: sizes above 1 "
        "are refused; it would need transformer-engine).")
    expert_model_parallel_size: int = Field(1, ge=1, description="--train-backend megatron: expert-parallel size.")
    use_distributed_optimizer: bool = Field(
        False, description="--train-backend megatron: megatron-core's distributed optimizer: gradients "
        "reduce-scattered over data parallel, each rank keeps the Adam state of its 1/DP shard of the "
        "weights (off: AdamW state for every weight of the rank's model shard).")

    @model_validator(mode="after")
    def _train_backend(self) -> PlacementTable:
        from milepost.train.megatron.preflight import check_train_backend

        check_train_backend(self)
        return self


class MemoryTable(Table):
    """Where the trainer's state lives between steps (report section 3.2)."""

    offload_train: bool | None = Field(
        None,
        description="Between steps, evict the trainer's weights, gradients and optimizer state "
        "from the device (back before the next step); default: on when --colocate, else off.",
    )
    offload_train_destination: Literal["host", "disk"] = Field(
        "host",
        description="--offload-train target: pinned host memory, or per-rank files under "
        "--offload-train-dir streamed through a staging buffer (host memory stays bounded).",
    )
    offload_train_dir: Path | None = Field(
        None, description="--offload-train-destination disk: a node-local directory; default RUN_DIR/offload."
    )
    offload_staging_bytes: int = Field(
        64 << 20, ge=1, description="Size of the pinned staging buffer of disk offload."
    )
    offload_actor_for_critic: bool | None = Field(
        None,
        description="With a PPO critic, the actor (weights, gradients, optimizer state) leaves the "
        "device while the critic computes or trains, and the critic while the actor trains, so a "
        "step's peak holds one of them (to --offload-train-destination); default: on with a critic "
        "on cuda, whatever the placement (report 3.2), off on cpu (no device memory to save).",
    )
    stream_optimizer_state_to_disk: bool = Field(
        False,
        description="Keep the Adam moments in per-bucket files; the optimizer step loads, updates "
        "and writes back one bucket at a time (the device never holds all of it).",
    )
    optimizer_state_dir: Path | None = Field(
        None, description="--stream-optimizer-state-to-disk: where; default RUN_DIR/optimizer_state."
    )
    optimizer_state_bucket_bytes: int = Field(
        256 << 20, ge=1, description="--stream-optimizer-state-to-disk: moment bytes per bucket file."
    )
    optimizer_moment_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="--stream-optimizer-state-to-disk: dtype of the stored Adam moments (bfloat16 "
        "halves the files; master weights stay fp32; float32 is bitwise plain AdamW).",
    )


class EngineTable(Table):
    engine_backend: Literal["embedded", "sglang", "external"] = Field(
        "embedded",
        description="embedded = milepost's engine (`milepost serve`); sglang = SGLang servers started "
        "by milepost; external = already-running servers at --engine-urls.",
    )
    engine_urls: list[str] | None = Field(
        None, description="Base URLs (http://host:port) of the servers of --engine-backend external."
    )
    api_key: str | None = Field(
        None, min_length=8, description="Key the engines, sglang-router and the session server "
        "require ('Authorization: Bearer KEY', SGLang's --api-key; docs/security.md); milepost's "
        "clients send it. With --engine-backend external: those servers' key. Default: none "
        "(everything binds 127.0.0.1).",
    )
    engine_mem_fraction_static: float = Field(
        0.8,
        gt=0,
        lt=1,
        description="On CUDA, share of the device's total memory that an engine's weights + KV "
        "pool may take (SGLang's meaning: the pool gets what is free after loading the weights "
        "minus (1 - share) * total).",
        json_schema_extra={"flags": ["--sglang-mem-fraction-static"]},
    )
    engine_max_total_tokens: int | None = Field(
        None, ge=1, description="KV pool size of each engine in tokens; default derived by the engine."
    )
    engine_page_size: int = Field(16, ge=1, description="Tokens per KV cache block of each engine.")
    engine_quantization: Literal["fp8"] | None = Field(
        None,
        description="fp8 = engines store their projection weights as float8_e4m3fn with one scale "
        "per output row, quantized at load and on every weight update; the equality check then "
        "admits the format's rounding error for those tensors.",
        json_schema_extra={"flags": ["--sglang-quantization"]},
    )
    engine_speculative_algorithm: Literal["NGRAM", "NEXTN", "EAGLE"] | None = Field(
        None,
        description="Speculative decoding in the engines, exact for RL (milepost serve "
        "--speculative-algorithm; docs/speculative.md): NGRAM, or NEXTN / EAGLE with the "
        "checkpoint's own multi-token-prediction layer (refused for a checkpoint without one).",
        json_schema_extra={"flags": ["--sglang-speculative-algorithm"]},
    )
    engine_speculative_num_steps: int | None = Field(
        None, ge=1, description="NEXTN / EAGLE: draft steps per verify (milepost serve "
        "--speculative-num-steps); default 3.",
        json_schema_extra={"flags": ["--sglang-speculative-num-steps"]},
    )
    engine_speculative_eagle_topk: int | None = Field(
        None, ge=1, description="NEXTN / EAGLE: proposals per step; 1 (a chain) only.",
        json_schema_extra={"flags": ["--sglang-speculative-eagle-topk"]},
    )
    engine_speculative_num_draft_tokens: int | None = Field(
        None, ge=2, description="Tokens verified per request and step, the last one included "
        "(milepost serve --speculative-num-draft-tokens); default num_steps + 1, or 4.",
        json_schema_extra={"flags": ["--sglang-speculative-num-draft-tokens"]},
    )
    engine_speculative_ngram_scope: Literal["request", "prompt", "engine"] | None = Field(
        None, description="NGRAM: which texts proposals come from (milepost serve "
        "--speculative-ngram-scope): request, prompt (a GRPO group's other samples too; the "
        "engine's default) or engine.",
        json_schema_extra={"flags": ["--sglang-speculative-ngram-scope"]},
    )
    true_on_policy: bool = Field(
        False,
        description="Engine and trainer assign bitwise-equal log-probs (report 5.3): the engines "
        "re-score each finished sequence with the trainer's computation and the trainer runs one "
        "sample per micro-batch (docs/true_on_policy.md). Dense Qwen3 / Llama on CPU (fp32, bf16) "
        "and CUDA bf16; refused otherwise.",
    )
    router: bool | None = Field(
        None,
        description="Put the engines behind sglang-router (sessions stick to one engine); "
        "default true when there is more than one engine.",
    )
