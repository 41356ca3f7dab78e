"""What is generated and how: data, rollouts, the fully-async loop, evaluation, agents, debug data."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from milepost.config_tables.base import Table


class DataTable(Table):
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
        "--prompt-data and --reward-fn: reasoning_gym:TASK, verifiers:NAME, openenv:NAME "
        "(docs/environments.md). Its "
        "--env-size prompts, made from --rollout-seed, are written into the run directory.",
    )
    env_size: int = Field(1000, ge=1, description="Number of prompts --env makes.")
    env_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Time limit of one episode of an --env that runs episodes (verifiers, "
        "openenv) or of an --agent: past it the episode fails, its group is not trained on, the "
        "run goes on.",
    )


class RolloutTable(Table):
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


class FullyAsyncTable(Table):
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


class EvalTable(Table):
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


class AgentTable(Table):
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
    agent: str | None = Field(
        None, description="An agent framework's agent in place of --agent-function-path: "
        "strands:MODULE:FACTORY, FACTORY(model) -> strands.Agent on the session server; "
        "--reward-fn grades its final text (docs/environments.md).")
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


class DebugTable(Table):
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
