"""The run configuration of `milepost train`: one typed, validated model from a TOML recipe + overrides.

Names follow the Miles/slime flags where they exist (`--hf-checkpoint`, `--rollout-batch-size`,
`--n-samples-per-prompt`, `--eps-clip-high`, `--use-kl-loss`, ...). Tables ([model], [rollout], ...)
only organize a recipe: every key is unique, and `--key value` on the command line sets it wherever
it lives. Deviation: the debug data flags are `--save-rollouts` / `--load-rollouts` / `--rollout-only`
(slime's `--save-debug-rollout-data`, `--load-debug-rollout-data`, `--debug-rollout-only` are aliases).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, ValidationError, field_validator, model_validator

from milepost.config_rules import default_run_dir, refusals, resolve_defaults
from milepost.config_tables import (
    BUILTIN_ESTIMATORS,
    BUILTIN_REWARDS,
    IMPORT_PATH,
    RESOLVED_NAME,
    TABLE_OF,
    TABLES,
    AgentTable,
    AlgorithmTable,
    CheckpointTable,
    DataTable,
    DebugTable,
    EngineTable,
    EvalTable,
    FullyAsyncTable,
    LoggingTable,
    LoraTable,
    MemoryTable,
    ModelTable,
    OpdTable,
    OptimizerTable,
    PlacementTable,
    PrecisionTable,
    RolloutTable,
    WeightsTable,
)
from milepost.connectors.env import check_env
from milepost.flags import flag_name
from milepost.recipe import (
    ConfigError,
    dump_toml,
    parse_overrides,
    read_recipe,
    validate_strict,
)

__all__ = ["TABLES", "TABLE_OF", "ConfigError", "TrainConfig", "default_run_dir", "load_config"]



def _check_dataset(flag: str, v: Path | None) -> Path | None:
    if v is None:
        return None
    if not v.is_file():
        raise ValueError(f"{flag} {v} does not exist; pass a JSONL or Parquet file")
    if v.suffix.lower() not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"{flag} {v} is neither JSONL (.jsonl/.json) nor Parquet (.parquet)")
    return v.absolute()


class TrainConfig(
    PrecisionTable,
    LoraTable,
    OpdTable,
    AgentTable,
    DebugTable,
    EvalTable,
    LoggingTable,
    WeightsTable,
    CheckpointTable,
    OptimizerTable,
    AlgorithmTable,
    RolloutTable,
    FullyAsyncTable,
    DataTable,
    EngineTable,
    MemoryTable,
    PlacementTable,
    ModelTable,
):
    """Validated at construction, which also resolves every derived default (device, dtype,
    router, global_batch_size, rollout_max_concurrency, transfer mode, run_dir...): after it,
    no field is "auto" or None except the optional ones that stay unset."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("hf_checkpoint")
    @classmethod
    def _hf_dir(cls, v: Path) -> Path:
        if not v.is_dir():
            raise ValueError(
                f"--hf-checkpoint {v} is not a directory; pass a local Hugging Face model "
                "directory (nothing is downloaded)"
            )
        if not (v / "config.json").is_file():
            raise ValueError(
                f"--hf-checkpoint {v} has no config.json; pass the directory that save_pretrained wrote"
            )
        return v.absolute()

    @field_validator("prompt_data")
    @classmethod
    def _prompts(cls, v: Path | None) -> Path | None:
        return _check_dataset("--prompt-data", v)

    @field_validator("eval_prompt_data")
    @classmethod
    def _eval_prompts(cls, v: Path | None) -> Path | None:
        return _check_dataset("--eval-prompt-data", v)

    @field_validator("load_rollouts")
    @classmethod
    def _load(cls, v: Path | None) -> Path | None:
        if v is not None and not v.exists():
            raise ValueError(f"--load-rollouts {v} does not exist; pass what --save-rollouts wrote")
        return None if v is None else v.absolute()

    @field_validator("run_dir", "save_rollouts")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        return None if v is None else v.expanduser().absolute()

    @field_validator("engine_urls")
    @classmethod
    def _urls(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        if not v:
            raise ValueError("--engine-urls is empty; give at least one http://host:port")
        bad = [u for u in v if not re.match(r"^https?://[^/\s]+", u)]
        if bad:
            raise ValueError(f"--engine-urls: {bad} are not http(s)://host:port URLs")
        return [u.rstrip("/") for u in v]

    @field_validator("reward_fn")
    @classmethod
    def _reward(cls, v: str) -> str:
        if v not in BUILTIN_REWARDS and not IMPORT_PATH.match(v):
            raise ValueError(
                f"--reward-fn {v!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
                "nor an import path module.sub:function"
            )
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: str | None) -> str | None:
        return None if v is None else check_env(v)

    @field_validator("advantage_estimator")
    @classmethod
    def _estimator(cls, v: str) -> str:
        if v not in BUILTIN_ESTIMATORS and not IMPORT_PATH.match(v):
            raise ValueError(
                f"unknown advantage estimator {v!r}; use one of {', '.join(BUILTIN_ESTIMATORS)} "
                "or an import path module.sub:function"
            )
        return v

    @field_validator("critic_hf_checkpoint")
    @classmethod
    def _critic_dir(cls, v: Path | None) -> Path | None:
        if v is not None and not (v / "config.json").is_file():
            raise ValueError(f"--critic-hf-checkpoint {v} is not a Hugging Face model directory (no config.json)")
        return None if v is None else v.absolute()

    @field_validator("group_reward_fn")
    @classmethod
    def _group_reward(cls, v: str | None) -> str | None:
        if v is not None and not IMPORT_PATH.match(v):
            raise ValueError(f"--group-reward-fn {v!r} is not an import path module.sub:function")
        return v

    @field_validator("rollout_top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"--rollout-top-k must be -1 (off) or >= 1; got {v}")
        return v

    @field_validator("resume")
    @classmethod
    def _resume(cls, v: str) -> str:
        if v not in ("auto", "never") and not Path(v).exists():
            raise ValueError(f"--resume {v!r} is neither auto, never, nor an existing checkpoint path")
        return v if v in ("auto", "never") else str(Path(v).absolute())

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        problems = refusals(self)
        if problems:
            raise ValueError("\n".join(problems))
        resolve_defaults(self)
        return self

    # ---- derived quantities the driver needs ----------------------------------------------------
    @property
    def samples_per_rollout(self) -> int:
        """rollout_batch_size * n_samples_per_prompt: samples produced by one RL step."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """Optimizer steps taken on one rollout's samples."""
        return self.samples_per_rollout // int(self.global_batch_size or self.samples_per_rollout)

    def write_resolved(self, run_dir: Path | None = None) -> Path:
        """Write every setting to <run_dir>/config.resolved.toml (loadable by load_config); its path."""
        run_dir = Path(run_dir or self.run_dir)  # type: ignore[arg-type]
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / RESOLVED_NAME
        tmp = path.with_suffix(".toml.tmp")
        header = (
            "Resolved settings of this run, written by milepost; rerun or resume with\n"
            f"  milepost train {path}"
        )
        tmp.write_text(dump_toml(self, TABLE_OF, header))
        if self.api_key:  # the file holds the key: readable by its owner only
            os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        return path


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = e["loc"]
        if e["type"] == "missing" and loc and loc[0] in TABLE_OF:
            name = str(loc[0])
            lines.append(
                f"{flag_name(name)} is required: set {name} in the recipe's [{TABLE_OF[name]}] "
                f"table or pass {flag_name(name)} VALUE"
            )
        elif e["type"] == "extra_forbidden" and loc:
            lines.append(f"unknown setting {loc[0]}")
        else:
            lines.append(_one(e))
    return "\n".join(lines)


def _one(e: Any) -> str:
    msg = e["msg"].removeprefix("Value error, ")
    loc = e["loc"]
    if loc and isinstance(loc[0], str) and loc[0] in TABLE_OF and not msg.startswith("--"):
        where = flag_name(loc[0]) + "".join(f"[{i}]" for i in loc[1:])
        return f"{where}: {msg}; got {e['input']!r}"
    return msg


def load_config(recipe: Path | str | None, overrides: list[str] | None = None) -> TrainConfig:
    """The validated config of a run: `recipe` (TOML; None = none), then `overrides` (`--key value`...).

    Relative paths are taken from the current directory (and stored absolute). Raises ConfigError
    naming every setting at fault. A missing run_dir becomes
    runs/<recipe stem>-<timestamp> (absolute), so the resolved config names its own run directory
    and `milepost train <run_dir>/config.resolved.toml` resumes that run.
    """
    values: dict[str, Any] = {}
    if recipe is not None:
        values.update(read_recipe(Path(recipe), TABLE_OF))
    values.update(parse_overrides(TrainConfig, list(overrides or [])))
    if values.get("run_dir") is None:
        values["run_dir"] = default_run_dir(Path(recipe).stem if recipe is not None else "run")
    try:
        return validate_strict(TrainConfig, values)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
