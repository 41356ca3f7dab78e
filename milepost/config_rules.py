"""Invalid combinations of a TrainConfig, refused at start, and its derived defaults.

Each refusal names every setting involved and the fix; all of them are reported at once.
Fully-async checks (e.g. fully async + colocate) join `refusals` with the fully-async flags.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from milepost.connectors.env import env_refusals
from milepost.lora.rules import lora_refusals
from milepost.onpolicy.rules import true_on_policy_refusals
from milepost.opd_rules import opd_coef_default, opd_refusals

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def default_run_dir(name: str = "run") -> Path:
    """runs/<name>-<YYYYmmdd-HHMMSS> under the current directory."""
    return Path("runs") / f"{name}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def refusals(c: TrainConfig) -> list[str]:
    """Every invalid combination, each naming the settings at fault and the fix."""
    p: list[str] = []
    if c.device == "cuda" and not _cuda_available():
        p.append("--device cuda was given but CUDA is not available; use --device cpu or auto")
    if c.prompt_data is None and c.load_rollouts is None and c.env is None:
        p.append(
            "--prompt-data is required (a JSONL or Parquet file of prompts), unless --load-rollouts "
            "trains on saved rollouts or --env makes them"
        )
    p += env_refusals(c.env, prompt_data=c.prompt_data, reward_fn=c.reward_fn,
                      load_rollouts=c.load_rollouts)
    if c.compile_layers and c.activation_checkpointing != "none":
        p.append("--compile-layers with --activation-checkpointing layer is not supported yet: "
                 "drop one of them")
    if c.load_rollouts is not None and c.rollout_only:
        p.append("--load-rollouts with --rollout-only would neither generate nor train; drop one of them")
    if c.engine_backend == "external" and not c.engine_urls:
        p.append("--engine-backend external needs --engine-urls (the servers' http://host:port)")
    if c.engine_backend != "external" and c.engine_urls:
        p.append(
            f"--engine-urls is only for --engine-backend external (got --engine-backend "
            f"{c.engine_backend}, whose engines milepost starts); drop --engine-urls or use external"
        )
    if (
        c.engine_backend == "external"
        and c.engine_urls
        and c.rollout_num_engines is not None
        and c.rollout_num_engines != len(c.engine_urls)
    ):
        p.append(
            f"--rollout-num-engines {c.rollout_num_engines} differs from the {len(c.engine_urls)} "
            "--engine-urls; drop --rollout-num-engines (it follows the URLs)"
        )
    if c.engine_quantization is not None and c.engine_backend != "embedded":
        p.append(
            f"--engine-quantization {c.engine_quantization} is milepost's engine storage (and its "
            f"check tolerance); --engine-backend {c.engine_backend} engines are configured where "
            "they start: drop --engine-quantization or use embedded"
        )
    if c.colocate and c.engine_backend == "external":
        p.append(
            "--colocate needs engines milepost starts beside the trainer, but --engine-backend external "
            "engines run elsewhere; drop --colocate or use embedded"
        )
    if c.colocate and c.update_weight_transfer_mode not in (None, "tensor"):
        p.append(
            f"--colocate moves weights by in-host handoff; --update-weight-transfer-mode "
            f"{c.update_weight_transfer_mode} is refused with it: use tensor (the default when colocated)"
        )
    if c.engine_backend == "embedded" and c.rollout_num_gpus_per_engine > 1:
        p.append(
            "--rollout-num-gpus-per-engine > 1 needs tensor parallelism, which --engine-backend embedded "
            "does not have; use 1 or --engine-backend sglang"
        )
    if c.engine_backend == "sglang" and importlib.util.find_spec("sglang") is None:
        p.append(
            "--engine-backend sglang needs the sglang package, which is not installed; use --engine-backend "
            "embedded (same protocol) or external"
        )
    if c.eps_clip_high < c.eps_clip:
        p.append(
            f"--eps-clip-high ({c.eps_clip_high}) is below --eps-clip ({c.eps_clip}); clip-higher "
            "needs eps_clip_high >= eps_clip"
        )
    if c.kl_loss_coef > 0 and not c.use_kl_loss:
        p.append(
            f"--kl-loss-coef {c.kl_loss_coef} has no effect without --use-kl-loss; add --use-kl-loss "
            "or set --kl-loss-coef 0"
        )
    p += objective_refusals(c)
    if c.min_lr > c.lr:
        p.append(f"--min-lr ({c.min_lr}) is above --lr ({c.lr}); the decay goes down to min_lr")
    samples = c.rollout_batch_size * c.n_samples_per_prompt
    if c.global_batch_size is not None and samples % c.global_batch_size:
        p.append(
            f"--global-batch-size {c.global_batch_size} must divide --rollout-batch-size * "
            f"--n-samples-per-prompt = {c.rollout_batch_size} * {c.n_samples_per_prompt} = {samples}"
        )
    gbs = c.global_batch_size or samples
    if gbs % c.actor_num_gpus_per_node:
        p.append(
            f"--global-batch-size {gbs} (default: rollout_batch_size * n_samples_per_prompt) must be a "
            f"multiple of --actor-num-gpus-per-node {c.actor_num_gpus_per_node} (each rank takes a share)"
        )
    p += _eval_refusals(c)
    p += _fully_async_refusals(c)
    p += weight_update_refusals(c)
    p += _model_refusals(c)
    p += agent_refusals(c)
    p += opd_refusals(c)
    p += lora_refusals(c)
    p += true_on_policy_refusals(c)
    if c.use_tensorboard and importlib.util.find_spec("tensorboard") is None:
        p.append("--use-tensorboard needs the tensorboard package: pip install tensorboard")
    if c.use_wandb and importlib.util.find_spec("wandb") is None:
        p.append("--use-wandb needs the wandb package: pip install wandb (it runs offline here)")
    if c.device == "cuda" and not p:
        p += _gpu_count_refusals(c)
    return p


def _cuda_available() -> bool:
    import torch  # deferred: only a run that asks about CUDA pays for importing torch

    return torch.cuda.is_available()


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _gpu_count_refusals(c: TrainConfig) -> list[str]:
    engines = c.rollout_num_engines or 1
    engine_gpus = 0 if c.engine_backend == "external" else engines * c.rollout_num_gpus_per_engine
    need = (
        max(c.actor_num_gpus_per_node, engine_gpus) if c.colocate else c.actor_num_gpus_per_node + engine_gpus
    )
    have = _visible_gpus()
    if need <= have:
        return []
    how = "max of" if c.colocate else "sum of"
    return [
        f"this placement needs {need} GPUs ({how} --actor-num-gpus-per-node {c.actor_num_gpus_per_node} and "
        f"--rollout-num-engines * --rollout-num-gpus-per-engine = {engine_gpus}) but {have} are visible; "
        "lower them" + ("" if c.colocate else " or use --colocate")
    ]


def resolve_defaults(c: TrainConfig) -> None:
    """Fill derived defaults in place (the model is frozen afterwards; this runs inside validation)."""

    def put(name: str, value: Any) -> None:
        object.__setattr__(c, name, value)

    if c.device == "auto":
        put("device", "cuda" if _cuda_available() else "cpu")
    if c.dtype == "auto":
        put("dtype", "bfloat16" if c.device == "cuda" else "float32")
    if c.max_tokens_per_micro_batch is None:  # measured: docs/training_speed.md
        put("max_tokens_per_micro_batch", 16384 if c.device == "cuda" else 4096)
    if c.rollout_num_engines is None:
        put("rollout_num_engines", len(c.engine_urls) if c.engine_urls else 1)
    if c.router is None:
        put("router", c.rollout_num_engines > 1)  # type: ignore[operator]
    if c.global_batch_size is None:
        put("global_batch_size", c.samples_per_rollout)
    if c.loss_aggregation is None:
        put("loss_aggregation", "sequence_mean" if c.advantage_estimator == "gspo" else "token_mean")
    if c.rollout_max_concurrency is None:
        put("rollout_max_concurrency", c.samples_per_rollout)
    if c.update_weight_transfer_mode is None:
        put("update_weight_transfer_mode", "tensor" if c.colocate else "broadcast")
    if c.update_weight_transfer_mode == "disk-delta" and c.update_weight_delta_dir is None:
        put("update_weight_delta_dir", Path(c.run_dir or default_run_dir()).absolute() / "weight_deltas")
    if c.run_dir is None:
        put("run_dir", default_run_dir().absolute())
    if c.use_rollout_logprobs is None:
        put("use_rollout_logprobs", c.fully_async and c.ratio_correction == "none")
    if c.offload_train is None:
        put("offload_train", c.colocate)  # the colocated engine needs the memory back
    if c.offload_actor_for_critic is None:
        put("offload_actor_for_critic", c.advantage_estimator == "ppo" and c.device == "cuda")
    if c.offload_train_dir is None and c.offload_train_destination == "disk":
        put("offload_train_dir", c.run_dir / "offload")
    if c.optimizer_state_dir is None and c.stream_optimizer_state_to_disk:
        put("optimizer_state_dir", c.run_dir / "optimizer_state")
    if (c.deterministic or c.true_on_policy) and c.trainer_cpu_threads is None:
        put("trainer_cpu_threads", 1)  # a reduction's order depends on the thread count
    if c.fully_async and c.max_inflight is None:
        put("max_inflight", c.samples_per_rollout)
    if c.fully_async and c.rollout_granularity is None:
        put("rollout_granularity", "sample")  # the report's default under fully async
    put("opd_coef", opd_coef_default(c))
    if c.opd_teacher_checkpoint is not None:
        put("opd_teacher_checkpoint", c.opd_teacher_checkpoint.absolute())


def _eval_refusals(c: TrainConfig) -> list[str]:
    """Evaluation runs on the rollout engines right after a weight update, so it needs both."""
    if c.eval_interval == 0:
        return ([f"--eval-prompt-data {c.eval_prompt_data} is set but --eval-interval is 0, so it "
                 "would never be used; set --eval-interval N or drop --eval-prompt-data"]
                if c.eval_prompt_data is not None else [])
    p: list[str] = []
    if c.eval_prompt_data is None:
        p.append(f"--eval-interval {c.eval_interval} needs --eval-prompt-data (the held-out prompts)")
    if c.load_rollouts is not None or c.rollout_only:
        p.append("--eval-interval needs engines and a policy that trains; it cannot be used with "
                 "--load-rollouts (no engines) or --rollout-only (no updates to evaluate)")
    if c.eval_interval % c.update_weights_interval:
        p.append(f"--eval-interval {c.eval_interval} must be a multiple of "
                 f"--update-weights-interval {c.update_weights_interval}: an evaluation measures "
                 "the weights just sent to the engines")
    return p


_ASYNC_ONLY = ("max_inflight", "rollout_granularity", "buffer_class", "max_staleness", "group_filter")


def _fully_async_refusals(c: TrainConfig) -> list[str]:
    """Fully asynchronous RL (report 2.2): its placement, buffer and staleness settings."""
    from milepost.config import _IMPORT_PATH

    p: list[str] = []
    if c.eval_mode == "external" and (c.eval_backend is None or c.eval_interval == 0):
        p.append("--eval-mode external needs --eval-backend module.sub:Class and --eval-interval N")
    if c.eval_backend is not None and c.eval_mode != "external":
        p.append("--eval-backend is only used with --eval-mode external; add it or drop --eval-backend")
    if c.eval_mode == "dedicated" and c.device == "cuda":
        p.append("--eval-mode dedicated runs its engines on CPU only for now; use --eval-mode "
                 "shared or external on GPUs")
    if c.eval_backend is not None and not _IMPORT_PATH.match(c.eval_backend):
        p.append(f"--eval-backend {c.eval_backend!r} is not an import path module.sub:Class")
    if not c.fully_async:
        given = [name for name in _ASYNC_ONLY if getattr(c, name) is not None]
        if c.eval_mode != "shared":
            given.append(f"eval_mode {c.eval_mode}")
        return p + ([f"--{given[0].replace('_', '-')} only applies to --fully-async runs; add "
                     "--fully-async or drop it"] if given else [])
    if c.deterministic:
        p.append("--deterministic needs the synchronous loop: under --fully-async which groups are "
                 "trained depends on timing; drop one of them")
    if c.colocate:
        p.append("--fully-async generates while the trainer trains, so trainer and engines need "
                 "devices of their own; it is refused with --colocate (drop one of them)")
    if c.load_rollouts is not None or c.rollout_only:
        p.append("--fully-async needs live engines and a trainer; it cannot be used with "
                 "--load-rollouts or --rollout-only")
    if c.save_rollouts is not None:
        p.append("--save-rollouts is not supported with --fully-async yet; drop one of them")
    if c.max_staleness is not None and c.max_staleness < 0:
        p.append(f"--max-staleness {c.max_staleness} is negative; use 0 (on-policy), a positive "
                 "number of weight versions, or leave it unset (no limit)")
    capacity = int(c.buffer_capacity_factor * c.rollout_batch_size)
    if capacity < c.rollout_batch_size:
        p.append(f"--buffer-capacity-factor {c.buffer_capacity_factor} gives a buffer of {capacity} "
                 f"groups, smaller than one train batch (--rollout-batch-size "
                 f"{c.rollout_batch_size}): no step could ever take its batch; use a factor >= 1")
    if c.max_inflight is not None and c.max_inflight < c.n_samples_per_prompt:
        p.append(f"--max-inflight {c.max_inflight} is below --n-samples-per-prompt "
                 f"{c.n_samples_per_prompt}: no group could ever start; raise it")
    for name in ("buffer_class", "group_filter"):
        path = getattr(c, name)
        if path is not None and not _IMPORT_PATH.match(path):
            p.append(f"--{name.replace('_', '-')} {path!r} is not an import path module.sub:name")
    return p


GROUP_ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus_baseline")
SCALAR_ESTIMATORS = ("grpo", "gspo")


def objective_refusals(c: TrainConfig) -> list[str]:
    """Estimator, critic, loss plug-in, KL, ratio-correction and R3 combinations (issue 7)."""
    p: list[str] = []
    est = c.advantage_estimator
    if est in GROUP_ESTIMATORS and c.n_samples_per_prompt < 2:
        p.append(f"--advantage-estimator {est} compares the samples of one prompt; --n-samples-per-prompt "
                 "must be >= 2")
    if est == "ppo" and c.critic_lr is None:
        p.append("--advantage-estimator ppo needs a learned value function: set --critic-lr (and optionally "
                 "--critic-hf-checkpoint, --value-clip, --gamma, --lambd)")
    if est != "ppo" and (c.critic_lr is not None or c.critic_hf_checkpoint is not None):
        p.append(f"--critic-lr / --critic-hf-checkpoint train a critic only for --advantage-estimator ppo "
                 f"(got {est}); drop them or use ppo")
    if c.offload_actor_for_critic and est != "ppo":
        p.append(f"--offload-actor-for-critic takes the actor off the device while a critic works; "
                 f"--advantage-estimator {est} has no critic: drop it or use ppo")
    if c.kl_coef > 0 and est in SCALAR_ESTIMATORS:
        p.append(f"--kl-coef puts a per-token KL penalty into the rewards, which {est} (one advantage per "
                 "sequence) cannot carry; use --use-kl-loss --kl-loss-coef instead")
    if (c.loss_type == "custom_loss") != (c.custom_loss_function_path is not None):
        p.append("--loss-type custom_loss and --custom-loss-function-path go together: set both or neither")
    elif c.custom_loss_function_path is not None:
        p += _plugin_refusal("milepost.train.losses", "get_loss", "custom_loss", c.custom_loss_function_path)
    if ":" in est:
        p += _plugin_refusal("milepost.train.advantages", "get_estimator", est)
    if c.tis_clip_low >= c.tis_clip:
        p.append(f"--tis-clip-low ({c.tis_clip_low}) must be below --tis-clip ({c.tis_clip})")
    if c.ratio_correction != "none" and c.use_rollout_logprobs:
        p.append(f"--ratio-correction {c.ratio_correction} weighs exp(trainer - rollout log-prob), which "
                 "--use-rollout-logprobs makes identically 1; drop one of them")
    if c.use_rollout_routing_replay and not _is_moe_checkpoint(c.hf_checkpoint):
        p.append(f"--use-rollout-routing-replay: {c.hf_checkpoint} is a dense model (no expert routing to "
                 "replay); turn it off or train a mixture-of-experts model")
    elif c.use_rollout_routing_replay and not _has_native_routing(c.hf_checkpoint):
        p.append(f"--use-rollout-routing-replay: {c.hf_checkpoint} runs on the transformers fallback, "
                 "which records and replays no expert routing (docs/models.md); turn it off or train a "
                 "natively supported MoE (see `milepost models`)")
    if c.use_rollout_routing_replay and c.critic_hf_checkpoint not in (None, c.hf_checkpoint):
        p.append("--use-rollout-routing-replay replays the policy's expert ids, which a critic from another "
                 "--critic-hf-checkpoint cannot take; drop --critic-hf-checkpoint (the critic then starts "
                 "from --hf-checkpoint)")
    return p


def _plugin_refusal(module: str, getter: str, *args: str) -> list[str]:
    """Load a plug-in the way the trainer will (torch imported only here); its error, or nothing."""
    try:
        getattr(importlib.import_module(module), getter)(*args)
    except ValueError as e:
        return [str(e)]
    return []


def _model_refusals(c: TrainConfig) -> list[str]:
    """What the checkpoint's architecture cannot do (docs/models.md), refused before anything starts."""
    import json

    from milepost.models.support import NATIVE, lookup

    path = Path(c.hf_checkpoint) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []  # reported where the checkpoint is read
    p = []
    if config.get("auto_map"):
        p.append(f"{path} has auto_map (custom modeling code): milepost train does not run custom code; "
                 "use a checkpoint transformers or milepost implements (see `milepost models`)")
    arch = (config.get("architectures") or [""])[0]
    if c.engine_quantization == "fp8" and arch and lookup(arch).path != NATIVE:
        p.append(f"--engine-quantization fp8 needs a native model; {arch} runs on the transformers "
                 "fallback (docs/models.md): drop --engine-quantization")
    return p


def _has_native_routing(path: Path) -> bool:
    import json

    from milepost.models.support import has_native_routing

    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures")
    return not archs or has_native_routing(archs[0])  # unnamed: the trainer decides at load


def _is_moe_checkpoint(path: Path) -> bool:
    import json

    cfg = json.loads((Path(path) / "config.json").read_text())
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0) > 0


def session_server_enabled(c: TrainConfig) -> bool:
    """True when the run starts the session server (asked for, or an agent fn needs it)."""
    return bool(c.use_session_server or c.agent_function_path is not None)


def _leaf_selection_refusals(c: TrainConfig) -> list[str]:
    """More than one sequence per session (report 2.4.1): branching only; the padding that keeps
    optimizer steps whole is exact under token_mean only (rollout/agentic.py)."""
    from milepost.config import _IMPORT_PATH
    from milepost.session.selection import BUILTIN_SELECTIONS

    sel = c.session_leaf_selection
    if sel not in BUILTIN_SELECTIONS and not _IMPORT_PATH.match(sel):
        return [f"--session-leaf-selection {sel!r} is neither {list(BUILTIN_SELECTIONS)} nor an "
                "import path module.sub:fn"]
    if sel == "latest":
        return []
    p = []
    if c.session_mode != "branching":
        p.append(f"--session-leaf-selection {sel} has no effect on a linear session (one leaf); "
                 "use --session-mode branching, or leave the selection at latest")
    aggregation = c.loss_aggregation or ("sequence_mean" if c.advantage_estimator == "gspo"
                                         else "token_mean")  # as resolve_defaults fills it
    if aggregation == "sequence_mean":
        p.append(f"--session-leaf-selection {sel} makes a step's sample count vary, and the "
                 "zero-weight samples that fill its last optimizer step would count in a "
                 "sequence_mean; use --loss-aggregation token_mean or selection latest")
    return p


def agent_refusals(c: TrainConfig) -> list[str]:
    """Rollout layers and the session server (report 2.3, 2.4)."""
    from milepost.config import _IMPORT_PATH
    from milepost.session.families import family_names
    from milepost.session.matchers import BUILTIN_MATCHERS

    p: list[str] = []
    for name in ("rollout_function_path", "custom_generate_function_path", "agent_function_path"):
        path = getattr(c, name)
        if path is not None and not _IMPORT_PATH.match(path):
            p.append(f"--{name.replace('_', '-')} {path!r} is not an import path module.sub:name")
    if c.rollout_function_path is not None and c.fully_async:
        p.append("--rollout-function-path owns data and grouping, which the --fully-async "
                 "rollout worker owns; drop one (agent and generate fns run under both loops)")
    if not session_server_enabled(c):
        return p
    if c.session_model_family is None:
        p.append(f"the session server needs --session-model-family (one of {family_names()}); "
                 "milepost never guesses a checkpoint's chat template family")
    elif c.session_model_family not in family_names():
        p.append(f"--session-model-family {c.session_model_family!r} is not registered; use one "
                 f"of {family_names()} (generic works for others but may diverge)")
    if c.session_matcher not in BUILTIN_MATCHERS and not _IMPORT_PATH.match(c.session_matcher):
        p.append(f"--session-matcher {c.session_matcher!r} is neither {list(BUILTIN_MATCHERS)} "
                 "nor an import path module.sub:fn")
    p += _leaf_selection_refusals(c)
    if c.session_divergence == "rollback" and c.session_mode == "branching":
        p.append("--session-divergence rollback has no effect on a branching session (a "
                 "divergent replay forks a branch, recorded as a fork); use --session-mode "
                 "linear, or leave --session-divergence at reject")
    if c.load_rollouts is not None:
        p.append("the session server generates live; it cannot be used with --load-rollouts")
    engines = len(c.engine_urls) if c.engine_urls else (c.rollout_num_engines or 1)
    if engines > 1 and c.router is False:
        p.append(f"the session server with {engines} engines needs the router (session affinity "
                 "through X-SMG-Routing-Key); drop --router false")
    return p


def weight_update_refusals(c: TrainConfig) -> list[str]:
    """Weight transports (report 4.3, 4.4): disk-delta's placement, pause mode with sessions."""
    p: list[str] = []
    mode = c.update_weight_transfer_mode
    # disk-delta with --colocate is refused above, with every mode but tensor.
    if mode == "disk-delta" and c.lora_rank:
        p.append("--update-weight-transfer-mode disk-delta does not carry LoRA adapters; use "
                 "broadcast (or tensor when colocated) for LoRA runs")
    if mode != "disk-delta" and (c.update_weight_delta_dir is not None
                                 or c.update_weight_delta_encoding != "xor"):
        p.append("--update-weight-delta-dir / --update-weight-delta-encoding only apply to "
                 "--update-weight-transfer-mode disk-delta; set that mode or drop them")
    if c.check_weight_update_equal_skip and not c.check_weight_update_equal:
        p.append("--check-weight-update-equal-skip has no effect without --check-weight-update-equal")
    if (c.check_weight_update or c.check_weight_update_equal) and c.engine_backend == "sglang":
        p.append("--check-weight-update(-equal) reads the engines' weights through milepost's "
                 "/weights_checksum, which an SGLang server lacks; use --engine-backend embedded")
    if c.pause_generation_mode == "abort" and session_server_enabled(c):
        p.append("--pause-generation-mode abort would tear down a session's token history "
                 "mid-trajectory, which the session server cannot tolerate; use retract or in_place")
    return p
