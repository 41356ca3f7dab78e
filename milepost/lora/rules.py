"""Run-config refusals of LoRA RL (report 5.1): what a LoRA run cannot combine with yet.

Disk-delta's refusal lives with the other weight-transport rules (config_rules.py); the checks
that need the model (MoE blocks, non-native architectures) run in the launcher's
preflight (`check_lora_model`, before any process starts) and again when the trainer attaches the
adapter (milepost/lora/adapters.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from milepost.lora.settings import ADAPTER_NAME, LoraSettings, parse_target_modules

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def lora_refusals(c: TrainConfig) -> list[str]:
    p = multi_lora_refusals(c)
    if not c.lora_rank:
        return p
    try:
        parse_target_modules(c.lora_target_modules)
    except ValueError as e:
        p.append(str(e))
    if c.update_weight_transfer_mode == "p2p":
        p.append("--update-weight-transfer-mode p2p does not carry LoRA adapters (it writes into "
                 "the engines' base weights); use broadcast (or tensor when colocated) with --lora-rank")
    if c.engine_backend == "sglang":
        p.append("--lora-rank with --engine-backend sglang: adapter weight updates use milepost's "
                 "engine endpoints; use --engine-backend embedded")
    if c.rollout_only:
        p.append("--lora-rank with --rollout-only: there is no trainer to create the adapter; drop one")
    if c.eval_mode != "shared":
        p.append(f"--lora-rank with --eval-mode {c.eval_mode}: its engines load full-model "
                 "snapshots, and a LoRA run exports adapters; use --eval-mode shared (the run's "
                 "engines evaluate with the adapter)")
    if not p and (Path(c.hf_checkpoint) / "config.json").is_file():
        try:
            names = tuple(str(a.get("name")) for a in c.adapters or ())  # multi-LoRA: not on experts
            check_lora_model(c.hf_checkpoint, LoraSettings(c.lora_rank, c.lora_alpha, c.lora_target_modules, names))
        except (ValueError, OSError) as e:
            p.append(str(e))
    return p


def check_lora_model(hf_checkpoint: str | Path, settings: LoraSettings) -> None:
    """Before any process starts: the adapter attaches to this checkpoint's native model (built
    on the meta device, nothing allocated). ValueError naming the layer and module otherwise:
    MoE blocks other than Qwen3-MoE's, gate_proj without up_proj on experts, multi-LoRA on
    experts, architectures that run through the transformers fallback."""
    import torch

    from milepost.lora.adapters import attach_lora
    from milepost.models.registry import checkpoint_config, model_class, native_reason

    config = checkpoint_config(hf_checkpoint)
    if not getattr(config, "architectures", None):
        return  # an unnamed architecture: the trainer decides when it loads the model
    reason = native_reason(config)
    if reason is not None:
        raise ValueError(f"--lora-rank: {hf_checkpoint} has no native model definition ({reason}); "
                         "LoRA trains and serves adapters on native models only (milepost/models/), "
                         "so train this one without --lora-rank")
    with torch.device("meta"):
        lm = model_class(config)(config)
    attach_lora(lm, settings)


def adapts_experts(hf_checkpoint: str | Path, target_modules: str | tuple[str, ...]) -> bool:
    """True when an adapter on `target_modules` adapts this checkpoint's mixture-of-experts experts
    (then the engines merge its expert deltas and hold that one adapter: milepost/lora/expert_merge.py)."""
    from milepost.lora.experts import EXPERT_MODULES
    from milepost.models.registry import checkpoint_config

    if not (Path(hf_checkpoint) / "config.json").is_file():
        return False
    config = checkpoint_config(hf_checkpoint)
    modules = parse_target_modules(target_modules)
    return bool(getattr(config, "num_experts", 0)) and any(
        all(m in modules for m in mods) for mods in EXPERT_MODULES.values())


ADAPTER_KEYS = ("name", "prompt_data", "reward_fn", "lr", "eval_prompt_data")


def multi_lora_refusals(c: TrainConfig) -> list[str]:
    """[[lora.adapters]] (multi-LoRA): well-formed entries, and what they cannot combine with yet."""
    if not c.adapters:
        return []
    from milepost.config_tables import BUILTIN_REWARDS, IMPORT_PATH

    p: list[str] = []
    if not c.lora_rank:
        p.append("[[lora.adapters]] needs --lora-rank > 0 (the adapters share rank, alpha and targets)")
    names = []
    for i, a in enumerate(c.adapters, start=1):
        where = f"[[lora.adapters]] entry {i}"
        unknown = sorted(set(a) - set(ADAPTER_KEYS))
        if unknown:
            p.append(f"{where}: unknown key(s) {unknown}; an entry has {list(ADAPTER_KEYS)}")
        name = a.get("name")
        names.append(name)
        if not isinstance(name, str) or not ADAPTER_NAME.match(name):
            p.append(f"{where}: name {name!r} must match {ADAPTER_NAME.pattern} (it names the adapter "
                     "in requests, metrics and weight updates)")
        data = a.get("prompt_data")
        if not isinstance(data, str) or not Path(data).is_file():
            p.append(f"{where} ({name}): prompt_data {data!r} is not a file; give each adapter its "
                     "JSONL/Parquet prompts")
        evals = a.get("eval_prompt_data")
        if evals is not None and (not isinstance(evals, str) or not Path(evals).is_file()):
            p.append(f"{where} ({name}): eval_prompt_data {evals!r} is not a file; give the adapter's "
                     "held-out JSONL/Parquet prompts or leave the key out")
        elif evals is not None and c.eval_interval == 0:
            p.append(f"{where} ({name}): eval_prompt_data is set but --eval-interval is 0, so it would "
                     "never be used; set --eval-interval N or drop the key")
        reward = a.get("reward_fn", c.reward_fn)
        if not isinstance(reward, str) or not (reward in BUILTIN_REWARDS or IMPORT_PATH.match(reward)):
            p.append(f"{where} ({name}): reward_fn {reward!r} is neither a builtin {list(BUILTIN_REWARDS)} "
                     "nor an import path 'module.sub:function'")
        lr = a.get("lr", c.lr)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
            p.append(f"{where} ({name}): lr {lr!r} must be a number > 0")
    if len(set(names)) != len(names):
        p.append(f"[[lora.adapters]]: names {names} repeat; each adapter needs its own name")
    for given, what in ((c.prompt_data is not None, "--prompt-data (each adapter names its prompt_data)"),
                        (c.eval_prompt_data is not None, ("--eval-prompt-data (give each adapter its "
                                                          "eval_prompt_data; eval/<name>/... per adapter)")),
                        (c.group_reward_fn is not None, "--group-reward-fn (each adapter has its reward_fn)"),
                        (c.check_weight_update_equal, ("--check-weight-update-equal (it covers one adapter's "
                                                       "tensors; --check-weight-update checks what each update sends)")),
                        (c.stream_optimizer_state_to_disk, "--stream-optimizer-state-to-disk"),
                        (c.env is not None, "--env (it makes one task's prompts)"),
                        (c.load_rollouts is not None, "--load-rollouts"),
                        *((given, f"{flag} (the session server's and the layers' requests name one adapter)")
                          for flag, given in (("--use-session-server", c.use_session_server),
                                              ("--agent-function-path", c.agent_function_path),
                                              ("--rollout-function-path", c.rollout_function_path),
                                              ("--custom-generate-function-path",
                                               c.custom_generate_function_path)))):
        if given:
            p.append(f"[[lora.adapters]] with {what}: not supported; drop it")
    return p
