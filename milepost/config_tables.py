"""The tables of the run configuration: each a group of settings with its types, defaults and
meaning (`milepost train --help` prints the descriptions). `TrainConfig` (config.py) inherits them
all; a recipe's [table] headers only organize keys, and `TABLE_OF` says where each key lives.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_MIB = 1 << 20
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
BUILTIN_REWARDS = ("exact_match", "math", "math_verify")  # math_verify: milepost[math]
BUILTIN_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
RESOLVED_NAME = "config.resolved.toml"


class _Table(BaseModel):
    # No NaN or infinity in any float setting (`--lr inf` would train the weights into NaN).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ModelTable(_Table):
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


class PlacementTable(_Table):
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


class MemoryTable(_Table):
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


class EngineTable(_Table):
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


class DataTable(_Table):
    prompt_data: Path | None = Field(
        None,
        description="Prompt dataset, JSONL (.jsonl/.json) or Parquet (.parquet); required "
        "unless --load-rollouts.",
    )
    input_key: str = Field(
        "prompt", description="Field of a record holding the prompt (text or chat messages)."
    )
    label_key: str = Field("label", description="Field of a record holding the label the reward compares to.")
    metadata_key: str = Field("metadata", description="Field of a record copied into Sample.metadata.")
    apply_chat_template: bool = Field(True, description="Render prompts with the checkpoint's chat template.")
    rollout_shuffle: bool = Field(True, description="Shuffle the prompts (each epoch) with --rollout-seed.")
    rollout_seed: int = Field(
        42, ge=0, description="Seed of the prompt shuffle and of rollout sampling seeds."
    )
    env: str | None = Field(
        None,
        description="An environment's prompts and grader as one setting, in place of "
        "--prompt-data and --reward-fn: reasoning_gym:TASK (docs/environments.md). Its "
        "--env-size prompts, made from --rollout-seed, are written into the run directory.",
    )
    env_size: int = Field(1000, ge=1, description="Number of prompts --env makes.")


class RolloutTable(_Table):
    num_rollout: int = Field(ge=1, description="Number of RL steps (rollout, train, weight update).")
    rollout_batch_size: int = Field(ge=1, description="Prompts per RL step.")
    n_samples_per_prompt: int = Field(8, ge=1, description="Samples (one group) per prompt.")
    rollout_max_response_len: int = Field(1024, ge=1, description="Most tokens generated per sample.")
    rollout_temperature: float = Field(1.0, ge=0, description="Sampling temperature of rollouts.")
    rollout_top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold of rollouts.")
    rollout_top_k: int = Field(-1, description="Top-k sampling of rollouts; -1 = off.")
    rollout_stop: list[str] | None = Field(None, description="Stop strings of rollouts.")
    rollout_stop_token_ids: list[int] | None = Field(
        None, description="Stop token ids of rollouts (besides EOS)."
    )
    reward_fn: str = Field(
        "exact_match",
        description="Reward of one sample: exact_match, math, or an import path module.sub:function.",
        json_schema_extra={"flags": ["--custom-rm-path"]},
    )
    group_reward_fn: str | None = Field(
        None,
        description="Reward of a whole group at once (import path module.sub:function); "
        "replaces --reward-fn when given.",
    )
    rollout_max_concurrency: int | None = Field(
        None,
        ge=1,
        description="Most generation requests in flight over all engines; default: every "
        "sample of a step (rollout_batch_size * n_samples_per_prompt).",
    )


class FullyAsyncTable(_Table):
    """Fully asynchronous RL (report section 2.2): engines generate while the trainer trains."""

    fully_async: bool = Field(
        False,
        description="Overlap rollout and training: a background worker keeps --max-inflight "
        "trajectories generating into a bounded buffer; each step trains on finished groups. "
        "Needs a disaggregated placement (refused with --colocate).",
    )
    max_inflight: int | None = Field(
        None, ge=1,
        description="--fully-async: most trajectories generating at once; default "
        "rollout_batch_size * n_samples_per_prompt.",
    )
    rollout_granularity: Literal["group", "sample"] | None = Field(
        None,
        description="--fully-async: when a finished trajectory frees its in-flight place: sample "
        "(at once; the default) or group (when the last trajectory of its group ends).",
    )
    buffer_capacity_factor: float = Field(
        2.0, gt=0,
        description="--fully-async: the buffer holds this many train batches of groups "
        "(capacity = factor * rollout_batch_size); putting a group blocks while it is full.",
    )
    buffer_class: str | None = Field(
        None,
        description="--fully-async: import path module.sub:Class of a buffer replacing the "
        "default (put / take / metrics / close; checked at start).",
    )
    max_staleness: int | None = Field(
        None,
        description="--fully-async: most weight versions a trained group may lag the trainer "
        "(trainer version - oldest token version in the group); 0 = on-policy; unset = no limit.",
    )
    stale_group_policy: Literal["retry", "discard"] = Field(
        "retry", description="--fully-async: a group past --max-staleness: its prompt is retried or discarded."
    )
    aborted_group_policy: Literal["retry", "discard"] = Field(
        "retry",
        description="--fully-async: a group generation gave up on (abort, timeout): its prompt is "
        "retried or discarded.",
    )
    group_filter: str | None = Field(
        None,
        description="--fully-async: import path of fn(group) -> bool; a group it rejects is "
        "discarded on arrival (e.g. milepost.data.filters:rewards_differ).",
        json_schema_extra={"flags": ["--dynamic-sampling-filter-path"]},
    )
    pause_generation_mode: Literal["retract", "in_place", "abort"] = Field(
        "retract",
        description="--fully-async: how engines pause for a weight update: retract / in_place "
        "(in-flight trajectories continue under the new weights) or abort (retried or discarded).",
    )


class AlgorithmTable(_Table):
    advantage_estimator: str = Field(
        "grpo",
        description="How rewards become advantages: grpo, gspo (sequence-level ratio), "
        "reinforce_plus_plus, reinforce_plus_plus_baseline, ppo (GAE over a learned critic; needs "
        "--critic-lr), or an import path module.sub:function taking (samples, settings, inputs).",
    )
    normalize_advantages: bool = Field(
        True,
        description="grpo/gspo: divide each group's centered rewards by the group's std; "
        "reinforce++/ppo: whiten advantages over the rollout's loss tokens.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of per-token rewards (ppo, reinforce++).")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo).")
    critic_lr: float | None = Field(
        None, gt=0, description="Learning rate of the PPO critic (a value model trained in the same ranks); "
        "required by --advantage-estimator ppo."
    )
    critic_hf_checkpoint: Path | None = Field(
        None, description="Hugging Face directory the critic starts from; default the policy's --hf-checkpoint."
    )
    value_clip: float = Field(0.2, gt=0, description="Critic loss: clip range of the value around its old value.")
    kl_coef: float = Field(
        0.0, ge=0, description="KL-to-reference penalty folded into per-token rewards (reinforce++, ppo); "
        "uses --kl-loss-type."
    )
    loss_type: Literal["policy_loss", "custom_loss"] = Field(
        "policy_loss", description="policy_loss (PPO-clip / GSPO) or custom_loss (--custom-loss-function-path)."
    )
    custom_loss_function_path: str | None = Field(
        None, description="A loss module.sub:function(batch: LossBatch, settings: LossSettings) -> (loss, sums)."
    )
    loss_aggregation: Literal["token_mean", "sequence_mean"] | None = Field(
        None, description="token_mean (over all loss tokens of a step) or sequence_mean (each response's "
        "token mean, averaged); default sequence_mean for gspo, else token_mean."
    )
    ratio_correction: Literal["none", "tis", "clip_or_pop"] = Field(
        "none", description="Train-rollout mismatch correction on r = exp(logp_train - logp_rollout): "
        "tis clamps r to [--tis-clip-low, --tis-clip] as a per-token weight; clip_or_pop drops tokens outside."
    )
    tis_clip_low: float = Field(0.0, ge=0, description="Lower end of the ratio-correction interval.")
    tis_clip: float = Field(2.0, gt=0, description="Upper end of the ratio-correction interval.")
    use_rollout_routing_replay: bool = Field(
        False, description="R3: the trainer's MoE layers use the experts the engine routed each token to."
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range below: ratio >= 1 - eps_clip.")
    eps_clip_high: float = Field(0.28, gt=0, description="PPO clip range above: ratio <= 1 + eps_clip_high.")
    use_kl_loss: bool = Field(False, description="Add a KL loss to the reference (initial) policy.")
    kl_loss_coef: float = Field(0.0, ge=0, description="Weight of the KL loss (needs --use-kl-loss).")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3", description="KL estimator (Schulman's k1/k2/k3; low_var_kl = k3 clamped to [-10, 10])."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    use_rollout_logprobs: bool | None = Field(
        None,
        description="Use the engine's log-probs as the old policy instead of recomputing them; "
        "default: on under --fully-async without a --ratio-correction (the PPO ratio is then "
        "taken against the weights that generated the group, however stale), else off.",
    )


class OptimizerTable(_Table):
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (Adam).")
    min_lr: float = Field(0.0, ge=0, description="Final learning rate of the cosine decay.")
    lr_warmup_iters: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    lr_decay_style: Literal["constant", "cosine"] = Field(
        "constant", description="Learning rate after warmup; cosine decays to --min-lr over the run."
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (AdamW).")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.98, ge=0, lt=1, description="Adam beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    clip_grad: float = Field(1.0, ge=0, description="Max global gradient norm; 0 = no clipping.")
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step; default rollout_batch_size * "
        "n_samples_per_prompt (one step per rollout).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Token budget of one micro-batch of a trainer rank (dynamic batching); default "
        "16384 on CUDA (one 16k-token micro-batch instead of two of 8k nearly halved a Qwen3-0.6B "
        "step on the H200: docs/training_speed.md), 4096 on CPU.",
        json_schema_extra={"flags": ["--max-tokens-per-gpu"]},
    )
    activation_checkpointing: Literal["none", "layer"] = Field(
        "none",
        description="Trainer activations: 'none' keeps every layer's for backward (fastest where it "
        "fits: measured on the H200, docs/training_speed.md); 'layer' recomputes each decoder layer "
        "in backward (less memory, ~30% slower on the Qwen3-0.6B shape).",
    )
    compile_layers: bool = Field(
        False,
        description="torch.compile each decoder layer's forward (dense models; attention stays eager). "
        "Opt-in: slower than eager layers on the H200 (docs/training_speed.md); refused with "
        "--activation-checkpointing layer.",
    )
    fused_kernels: bool = Field(
        True,
        description="On CUDA, the trainer's Triton kernels with backward: RMSNorm, RoPE, SiLU-and-mul, "
        "LM-head log-prob + entropy without fp32 [tokens, vocab] logits, grouped-GEMM MoE experts "
        "(docs/training_speed.md); off = the torch ops. No effect on CPU.",
    )
    separate_old_logprob_pass: bool = Field(
        False,
        description="Score the old policy in its own no-grad pass even with one optimizer step per "
        "rollout (by default the training forward's own log-probs, detached, are the old policy's).",
    )


class CheckpointTable(_Table):
    run_dir: Path | None = Field(
        None,
        description="Directory of this run (checkpoints, metrics, logs); default "
        "runs/<recipe name>-<timestamp>.",
    )
    save_interval: int = Field(0, ge=0, description="Save a checkpoint every N steps; 0 = only at the end.")
    resume: str = Field(
        "auto",
        description="auto = continue from the latest checkpoint in --run-dir if any; never; "
        "or the path of a checkpoint.",
    )
    save_hf_at_end: bool = Field(True, description="Write the final weights as a Hugging Face directory.")


class WeightsTable(_Table):
    update_weight_buffer_size: int = Field(
        512 * _MIB, ge=_MIB, description="Bytes per weight-update bucket (trainer to engines)."
    )
    update_weights_interval: int = Field(1, ge=1, description="Push weights to the engines every N steps.")
    update_weight_transfer_mode: Literal["tensor", "broadcast", "p2p", "disk-delta"] | None = Field(
        None,
        description="tensor = in-host handoff; broadcast = one torch.distributed group to every "
        "engine; p2p = point-to-point writes per engine (transfer plan, one staging buffer); "
        "disk-delta = changed bytes published to --update-weight-delta-dir (report 4.3). "
        "Default: tensor when colocated, else broadcast.",
    )
    update_weight_delta_dir: Path | None = Field(
        None,
        description="disk-delta: the version store, a directory trainer and engines both see at "
        "the same path; default <run_dir>/weight_deltas.",
    )
    update_weight_delta_encoding: Literal["xor", "overwrite"] = Field(
        "xor",
        description="disk-delta: xor (compact; applied exactly once on its declared base) or "
        "overwrite (changed positions + new values; idempotent).",
    )
    check_weight_update: bool = Field(
        False, description="After each update, verify the engines hold exactly the trainer's weights."
    )
    check_weight_update_equal: bool = Field(
        False,
        description="Once, at the first update: fill every engine tensor with noise, update, then "
        "require every engine tensor to equal the trainer's bit for bit (report 4.4).",
    )
    check_weight_update_equal_skip: list[str] | None = Field(
        None,
        description="--check-weight-update-equal: engine tensor names (globs, e.g. '*.k_scale') "
        "that live only on the rollout side and are not compared.",
    )


class LoggingTable(_Table):
    use_tensorboard: bool = Field(False, description="Also log metrics to TensorBoard (run_dir/tensorboard).")
    use_wandb: bool = Field(
        False, description="Also log metrics to Weights & Biases, offline mode (run_dir/wandb)."
    )
    wandb_project: str = Field("milepost", description="W&B project name.")
    log_interval: int = Field(1, ge=1, description="Log metrics every N steps.")


class EvalTable(_Table):
    eval_interval: int = Field(
        0, ge=0,
        description="Evaluate every N steps (and after the last) on --eval-prompt-data; 0 = never.",
    )
    eval_prompt_data: Path | None = Field(
        None, description="Evaluation prompts (JSONL or Parquet; same keys as --prompt-data)."
    )
    n_samples_per_eval_prompt: int = Field(1, ge=1, description="Samples per evaluation prompt.")
    eval_max_response_len: int | None = Field(
        None, ge=1, description="Most tokens per evaluation sample; default --rollout-max-response-len."
    )
    eval_temperature: float | None = Field(
        None, ge=0, description="Evaluation sampling temperature; default --rollout-temperature."
    )
    eval_top_p: float | None = Field(
        None, gt=0, le=1, description="Evaluation nucleus threshold; default --rollout-top-p."
    )
    eval_mode: Literal["shared", "dedicated", "external"] = Field(
        "shared",
        description="shared = on the rollout engines (under --fully-async new generation holds "
        "meanwhile); --fully-async only: dedicated = --eval-num-engines engines of their own load "
        "an exported snapshot; external = --eval-backend scores the snapshot; both in the "
        "background while training goes on (report table 3).",
    )
    eval_num_engines: int = Field(
        1, ge=1, description="--eval-mode dedicated: evaluation engines (CPU only for now)."
    )
    eval_backend: str | None = Field(
        None,
        description="--eval-mode external: import path module.sub:Class; "
        "Class().evaluate(checkpoint_dir, prompt_data, step) -> dict of numbers.",
    )
    max_outstanding_evals: int = Field(
        1, ge=1,
        description="--eval-mode external: evaluations running at once; one due beyond it is "
        "skipped (recorded with the reason), never waited for.",
    )


class DebugTable(_Table):
    save_rollouts: Path | None = Field(
        None,
        description="Save every step's rollout data under this directory.",
        json_schema_extra={"flags": ["--save-debug-rollout-data"]},
    )
    load_rollouts: Path | None = Field(
        None,
        description="Train on rollouts saved by --save-rollouts instead of generating.",
        json_schema_extra={"flags": ["--load-debug-rollout-data"]},
    )
    rollout_only: bool = Field(
        False,
        description="Generate (and save) rollouts without training.",
        json_schema_extra={"flags": ["--debug-rollout-only"]},
    )
    deterministic: bool = Field(
        False,
        description="Repeatable runs (the metric-history gate, docs/testing.md): every rollout and "
        "eval request samples with its own seed (from --seed, its group and sample index), so its "
        "tokens do not depend on how the engine batched it; trainer ranks use one CPU thread "
        "unless --trainer-cpu-threads says otherwise. Refused with --fully-async (which groups "
        "arrive first depends on timing).",
    )


class AgentTable(_Table):
    """Agentic rollout (report 2.3, 2.4): plug-in layers and the TITO session server."""

    rollout_function_path: str | None = Field(
        None, description="Outermost layer, module.sub:fn: owns data, grouping and group rewards "
        "(milepost/rollout/layers.py RolloutFn).")
    custom_generate_function_path: str | None = Field(
        None, description="Generate layer, module.sub:fn: one prompt -> one Sample, recording its "
        "own tokens (layers.py GenerateFn).")
    agent_function_path: str | None = Field(
        None, description="Innermost layer, module.sub:fn: runs the agent loop against the session "
        "server's OpenAI base URL (layers.py AgentFn); turns the session server on.")
    use_session_server: bool = Field(
        False, description="Start the TITO session server (on by itself with --agent-function-path).")
    session_mode: Literal["linear", "branching"] = Field(
        "linear", description="linear: extend the tail only, one sequence per session; branching: "
        "append-only tree, one sequence per leaf.")
    session_matcher: str = Field(
        "strict", description="Replay comparison: strict | json_args | omit_reasoning | loose "
        "(risky) | module.sub:fn (docs/sessions.md).")
    session_divergence: Literal["reject", "rollback"] = Field(
        "reject", description="A linear session's answer to a request that replays its history "
        "differently: reject (409 naming the message and field) | rollback (to the longest stored "
        "prefix; recorded, rollout/session_rollbacks).")
    session_leaf_selection: str = Field(
        "latest", description="Which leaves of a session are trained on: latest (one sequence per "
        "session) | all (every leaf of a branching session) | module.sub:fn (a selector over one "
        "Sample per leaf; milepost/session/selection.py).")
    session_model_family: str | None = Field(
        None, description="Chat template + parsers family of the checkpoint (`milepost.session."
        "families.family_names()`, docs/sessions.md); never detected, required with the session "
        "server.")


class OpdTable(_Table):
    """On-policy distillation (report 5.2; docs/distillation.md): a teacher's per-token signal."""

    opd_teacher_url: str | None = Field(
        None, description="Served teacher (any SGLang-protocol server sharing the student's "
        "tokenizer): scores every finished trajectory during rollout.")
    opd_teacher_checkpoint: Path | None = Field(
        None, description="In-process teacher: a Hugging Face directory of the student's "
        "architecture, loaded in the trainer ranks and scoring each batch in the train step.")
    teachers: list[dict[str, str]] | None = Field(
        None, description="Several served teachers, [[opd.teachers]] url = ..., tag = ...: a "
        "prompt goes to the teacher whose tag its metadata.teacher names.",
        json_schema_extra={"flags": ["--opd-teachers"]})
    opd_coef: float | None = Field(
        None, gt=0, description="Scale of the reverse-KL estimate subtracted from each token's "
        "advantage; default 1.0 with a teacher.")
    opd_task_reward: bool = Field(
        True, description="With a teacher: keep the task reward in the advantages; off "
        "(--no-opd-task-reward) distils alone (rewards are still computed and logged).")
    opd_top_k: int = Field(
        0, ge=0, description="Served teacher: score K candidates per position (0 = the sampled "
        "token only); the estimate is their student-probability-weighted difference.")
    opd_top_k_set: Literal["student", "intersection"] = Field(
        "student", description="--opd-top-k candidates: the student's top-K, or its intersection "
        "with the teacher's top-K (the sampled token where it is empty).")
    opd_teacher_timeout_s: float = Field(
        300.0, gt=0, description="Served teacher: time limit of one scoring request.")
    opd_teacher_retries: int = Field(
        2, ge=0, description="Served teacher: retries of a failed scoring request before the "
        "group is given up (its prompt retried later, counted in opd/teacher_failed_groups).")


class LoraTable(_Table):
    """LoRA RL (report 5.1; docs/lora.md): train an adapter on the frozen base; engines serve it."""

    lora_rank: int = Field(
        0, ge=0, description="Rank r of the adapter (A [r, in], B [out, r]); 0 = full-parameter "
        "training.")
    lora_alpha: float = Field(
        16.0, gt=0, description="The adapter's update is B A * alpha / r (PEFT's lora_alpha).")
    lora_target_modules: str = Field(
        "all-linear", description="Projections that get an adapter, comma-separated (q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or all-linear.")


TABLES: dict[str, type[_Table]] = {
    "model": ModelTable,
    "placement": PlacementTable,
    "memory": MemoryTable,
    "engine": EngineTable,
    "data": DataTable,
    "rollout": RolloutTable,
    "fully_async": FullyAsyncTable,
    "algorithm": AlgorithmTable,
    "optimizer": OptimizerTable,
    "checkpoint": CheckpointTable,
    "weights": WeightsTable,
    "logging": LoggingTable,
    "eval": EvalTable,
    "debug": DebugTable,
    "agent": AgentTable,
    "opd": OpdTable,
    "lora": LoraTable,
}
TABLE_OF: dict[str, str] = {name: t for t, cls in TABLES.items() for name in cls.model_fields}
