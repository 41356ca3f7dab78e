"""Checks made before a run starts anything, and `RunError`, the error a run reports without traceback.

`preflight` runs in the launcher before any engine starts: the reward functions import, every
row of the prompt files parses and tokenizes, the longest prompt plus the response length fits
the model's context, and the checkpoint a resume would load was trained from this model. (Rank 0
reads the prompt files again as it starts: a second tokenization, for a refusal in seconds
instead of after the engines' start.) A checkpoint records the model it was trained from
(`model_fingerprint`, in the checkpoint's extra) so a resume can tell, and its LoRA layout
(`lora_fingerprint`): an adapter of another rank, targets or names would not load into this run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from milepost.config import TrainConfig
from milepost.lora.settings import parse_target_modules
from milepost.rollout.rewards import load_group_reward_fn, load_reward_fn

log = logging.getLogger(__name__)

# config.json keys that do not change what the weights mean: left out of the comparison.
_NOT_THE_MODEL = {"transformers_version", "dtype", "torch_dtype", "use_cache", "_name_or_path",
                  "initializer_range"}


class RunError(RuntimeError):
    """A run cannot start or go on, for a reason its message fully states (bad input, a
    component gone): reported as one line, without a traceback."""


def preflight(cfg: TrainConfig) -> None:
    """Refuse, before any process starts, what would only fail once engines and ranks are up."""
    if cfg.load_rollouts is None:
        load_reward_fns(cfg)
        check_plugins(cfg)
        check_prompt_files(cfg)
    if cfg.fully_async:
        load_fully_async_plugins(cfg)
    path = resume_checkpoint(cfg)
    if path is not None and not cfg.rollout_only:
        check_resume(cfg, path)


def load_reward_fns(cfg: TrainConfig) -> tuple[Any, Any]:
    """(reward_fn, group_reward_fn or None), imported; RunError naming the setting if not."""
    try:
        reward_fn = load_reward_fn(cfg.reward_fn)
        group_fn = load_group_reward_fn(cfg.group_reward_fn) if cfg.group_reward_fn else None
    except ValueError as e:  # the loaders name the setting and what failed to import
        raise RunError(f"{e}; check the import path (is its module on PYTHONPATH?)") from None
    return reward_fn, group_fn


def check_plugins(cfg: TrainConfig) -> None:
    """Every plug-in layer given by import path imports (the config itself loads estimators and
    losses), and a session server's model family renders this checkpoint's chat
    template append-only; RunError naming the setting otherwise."""
    from milepost.config_rules import session_server_enabled
    from milepost.plugins import load_callable

    try:
        for path, flag in ((cfg.rollout_function_path, "--rollout-function-path"),
                           (cfg.custom_generate_function_path, "--custom-generate-function-path"),
                           (cfg.agent_function_path, "--agent-function-path")):
            if path is not None:
                load_callable(path, flag)
        if session_server_enabled(cfg):
            from milepost.session.matchers import load_matcher
            from milepost.session.runner import make_renderer
            from milepost.session.selection import load_leaf_selector

            load_matcher(cfg.session_matcher)
            load_leaf_selector(cfg.session_leaf_selection)
            make_renderer(cfg.hf_checkpoint, cfg.session_model_family)
    except ValueError as e:  # the loaders name the setting; FamilyError/RenderError included
        raise RunError(str(e)) from None


def check_prompt_files(cfg: TrainConfig) -> None:
    """Every row of --prompt-data / --eval-prompt-data reads and tokenizes as rank 0 will read
    it, and prompt + response fit the context the engines serve; RunError naming the file,
    row and setting otherwise."""
    from transformers import AutoTokenizer

    from milepost.data.source import DatasetError, PromptDataset

    context = _context_length(cfg.hf_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
    for flag, path, response_len, response_flag in (
        ("--prompt-data", cfg.prompt_data, cfg.rollout_max_response_len,
         "--rollout-max-response-len"),
        ("--eval-prompt-data", cfg.eval_prompt_data,
         cfg.eval_max_response_len or cfg.rollout_max_response_len,
         "--eval-max-response-len" if cfg.eval_max_response_len else "--rollout-max-response-len"),
        *((f"[[lora.adapters]] {a['name']}: prompt_data", a["prompt_data"], cfg.rollout_max_response_len,
           "--rollout-max-response-len") for a in cfg.adapters or []),  # multi-LoRA
    ):
        if path is None:
            continue
        try:
            items = PromptDataset.from_file(
                path, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                metadata_key=cfg.metadata_key, apply_chat_template=cfg.apply_chat_template,
                shuffle=False).items
        except DatasetError as e:
            raise RunError(f"{flag}: {e}") from None
        if flag == "--prompt-data":
            _check_teachers(cfg, tokenizer, items)
        longest = max(items, key=lambda it: len(it.prompt_ids))
        if context is not None and len(longest.prompt_ids) + response_len > context:
            room = context - len(longest.prompt_ids)
            raise RunError(
                f"{flag} {path}: its longest prompt (row {longest.index + 1}, "
                f"{len(longest.prompt_ids)} tokens) plus {response_flag} {response_len} is "
                f"more than the {context} tokens the model serves (max_position_embeddings in "
                f"{cfg.hf_checkpoint}/config.json); "
                + (f"lower {response_flag} to {room} or shorten the prompts" if room > 0 else
                   "shorten the prompts"))


def _context_length(hf_checkpoint: Path) -> int | None:
    """The longest sequence the engines serve: the model config's max_position_embeddings."""
    config = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def load_fully_async_plugins(cfg: TrainConfig) -> tuple[Any, Any]:
    """(buffer class or None, group filter or None), imported; the buffer class must pass the
    buffer contract (milepost/data/buffer.py). RunError naming the setting if not."""
    from milepost.data.buffer import check_buffer_class
    from milepost.plugins import load_callable

    try:
        buffer_cls = load_callable(cfg.buffer_class, "--buffer-class") if cfg.buffer_class else None
        if buffer_cls is not None:
            check_buffer_class(buffer_cls, cfg.buffer_class)
        keep = load_callable(cfg.group_filter, "--group-filter") if cfg.group_filter else None
        if cfg.eval_mode == "external":
            from milepost.eval.external import load_backend

            load_backend(cfg.eval_backend)
    except ValueError as e:
        raise RunError(str(e)) from None
    return buffer_cls, keep


def resume_checkpoint(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run continues from: the latest of run_dir (auto), the given one, or None."""
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto" and not (Path(cfg.run_dir) / "checkpoints").is_dir():
        return None  # a fresh run: the launcher need not import torch (below) to know it
    from milepost.train.checkpoint import META_FILE, latest_checkpoint

    if cfg.resume == "auto":
        return latest_checkpoint(cfg.run_dir)
    path = Path(cfg.resume)
    if not (path / META_FILE).is_file():
        raise RunError(f"--resume {path} is not a complete milepost checkpoint (no {META_FILE}); "
                       "pass a RUN_DIR/checkpoints/step_N directory, or auto / never")
    return path


def finished_checkpoint(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run would resume from when it already holds the last step
    (--num-rollout), else None: rerunning a finished run need not start engines and ranks that
    would load, train no step and stop (seconds on a tiny model, minutes on a large one)."""
    if cfg.rollout_only:
        return None
    path = resume_checkpoint(cfg)
    if path is None:
        return None
    from milepost.train.checkpoint import META_FILE

    step = json.loads((path / META_FILE).read_text()).get("extra", {}).get("step")
    return path if isinstance(step, int) and step + 1 >= cfg.num_rollout else None


def model_fingerprint(hf_checkpoint: Path) -> dict[str, Any]:
    """What a checkpoint records of the model it was trained from: its path and its config."""
    config = json.loads((Path(hf_checkpoint) / "config.json").read_text())
    return {"hf_checkpoint": str(hf_checkpoint),
            "config": {k: v for k, v in config.items() if k not in _NOT_THE_MODEL}}


def lora_fingerprint(cfg: TrainConfig) -> dict[str, Any] | None:
    """What a checkpoint records of the run's LoRA layout; None for full-parameter training."""
    if not cfg.lora_rank:
        return None
    return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha,
            "target_modules": list(parse_target_modules(cfg.lora_target_modules)),
            "adapters": [a["name"] for a in cfg.adapters or []]}


def _lora_text(lora: dict[str, Any] | None) -> str:
    if lora is None:
        return "full-parameter training (no --lora-rank)"
    names = f" and [[lora.adapters]] {lora['adapters']}" if lora["adapters"] else ""
    return (f"--lora-rank {lora['rank']} --lora-alpha {lora['alpha']} "
            f"--lora-target-modules {','.join(lora['target_modules'])}{names}")


def check_resume(cfg: TrainConfig, path: Path) -> None:
    """Refuse a checkpoint trained from another model (its weights would not fit, or would be
    silently trained on as if they were this model's)."""
    from milepost.train.checkpoint import META_FILE

    extra = json.loads((path / META_FILE).read_text()).get("extra", {})
    which = (f"--resume {path}" if cfg.resume != "auto"
             else f"the latest checkpoint of --run-dir {cfg.run_dir} ({path})")
    if "lora" in extra and extra["lora"] != lora_fingerprint(cfg):
        raise RunError(
            f"{which} was trained with {_lora_text(extra['lora'])}, but this run has "
            f"{_lora_text(lora_fingerprint(cfg))}; resume with the LoRA settings it was trained "
            "with, or start afresh in another --run-dir (or with --resume never)")
    saved = extra.get("model")
    if saved is None:  # written before checkpoints recorded their model: nothing to compare
        return
    now = model_fingerprint(cfg.hf_checkpoint)
    diffs = sorted(k for k in saved["config"].keys() | now["config"].keys()
                   if saved["config"].get(k) != now["config"].get(k))
    if diffs:
        shown = "; ".join(f"{k}: {saved['config'].get(k)!r} there, {now['config'].get(k)!r} here"
                          for k in diffs[:6])
        raise RunError(
            f"{which} was trained from {saved['hf_checkpoint']}, a different model than "
            f"--hf-checkpoint {cfg.hf_checkpoint} ({shown}); resume with the model it was "
            "trained from, or start afresh in another --run-dir (or with --resume never)")
    if saved["hf_checkpoint"] != now["hf_checkpoint"]:
        log.warning("%s was trained from %s; resuming it with --hf-checkpoint %s, whose config "
                    "is the same", which, saved["hf_checkpoint"], cfg.hf_checkpoint)


def _check_teachers(cfg: TrainConfig, tokenizer: Any, items: list) -> None:
    """Served distillation teachers answer and share the tokenizer; every prompt's tag has one."""
    from milepost.rollout.teacher import TeacherError, teachers_of_run

    try:
        teachers_of_run(cfg, tokenizer, items)
    except TeacherError as e:
        raise RunError(str(e)) from None
