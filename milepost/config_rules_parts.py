"""Refusals for the parts a run plugs together: the model, agents and sessions, weight updates."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def model_refusals(c: TrainConfig) -> list[str]:
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


def checkpoint_has_native_routing(path: Path) -> bool:
    import json

    from milepost.models.support import has_native_routing

    archs = json.loads((Path(path) / "config.json").read_text()).get("architectures")
    return not archs or has_native_routing(archs[0])  # unnamed: the trainer decides at load


def is_moe_checkpoint(path: Path) -> bool:
    import json

    cfg = json.loads((Path(path) / "config.json").read_text())
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0) > 0


def session_server_enabled(c: TrainConfig) -> bool:
    """True when the run starts the session server (asked for, or an agent fn needs it)."""
    return bool(c.use_session_server or c.agent_function_path is not None)


def _leaf_selection_refusals(c: TrainConfig) -> list[str]:
    """More than one sequence per session (report 2.4.1): branching only; the padding that keeps
    optimizer steps whole is exact under token_mean only (rollout/agentic.py)."""
    from milepost.config_tables import IMPORT_PATH
    from milepost.session.selection import BUILTIN_SELECTIONS

    sel = c.session_leaf_selection
    if sel not in BUILTIN_SELECTIONS and not IMPORT_PATH.match(sel):
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
    from milepost.config_tables import IMPORT_PATH
    from milepost.session.families import family_names
    from milepost.session.matchers import BUILTIN_MATCHERS

    p: list[str] = []
    for name in ("rollout_function_path", "custom_generate_function_path", "agent_function_path"):
        path = getattr(c, name)
        if path is not None and not IMPORT_PATH.match(path):
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
    if c.session_matcher not in BUILTIN_MATCHERS and not IMPORT_PATH.match(c.session_matcher):
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
