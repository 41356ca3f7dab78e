"""The run configuration of `milepost sft`: supervised fine-tuning on a chat dataset, no engine.

Same machinery as `milepost train` (TOML recipe tables + `--key value` overrides, the resolved
config written into the run directory); the optimizer and checkpoint settings keep train's names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from milepost.config import ModelTable, OptimizerTable, _format_errors
from milepost.config_rules import default_run_dir
from milepost.recipe import ConfigError, dump_toml, parse_overrides, read_recipe, validate_strict

RESOLVED_NAME = "config.resolved.toml"


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SFTDataTable(_Table):
    sft_data: Path = Field(description="JSONL of conversations: one {\"messages\": [{role, content}, ...]} per line.")
    messages_key: str = Field("messages", description="Field of a row holding the conversation.")
    max_seq_len: int = Field(2048, ge=2, description="Longer conversations are truncated (and counted).")


class SFTTrainingTable(_Table):
    num_epoch: int = Field(1, ge=1, description="Passes over the dataset (shuffled anew each epoch).")
    data_seed: int = Field(42, ge=0, description="Seed of the per-epoch shuffle.")
    loss_aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean", description="Mean over all assistant tokens of a step, or over conversations."
    )
    actor_num_gpus_per_node: int = Field(1, ge=1, description="Trainer ranks (processes on CPU).")


class SFTCheckpointTable(_Table):
    run_dir: Path | None = Field(None, description="Directory of this run; default runs/<recipe>-<timestamp>.")
    save_interval: int = Field(0, ge=0, description="Save a checkpoint every N optimizer steps; 0 = only at the end.")
    resume: Literal["auto", "never"] = Field("auto", description="auto = continue from the latest checkpoint in run_dir.")
    save_hf_at_end: bool = Field(True, description="Export the final weights as a Hugging Face directory (run_dir/hf).")
    log_interval: int = Field(1, ge=1, description="Log metrics every N steps.")


class _SFTOptimizer(OptimizerTable):
    global_batch_size: int = Field(32, ge=1, description="Conversations per optimizer step, over all ranks.")


TABLES: dict[str, type[BaseModel]] = {
    "model": ModelTable,
    "data": SFTDataTable,
    "training": SFTTrainingTable,
    "optimizer": _SFTOptimizer,
    "checkpoint": SFTCheckpointTable,
}
TABLE_OF: dict[str, str] = {name: t for t, cls in TABLES.items() for name in cls.model_fields}


class SFTConfig(SFTCheckpointTable, _SFTOptimizer, SFTTrainingTable, SFTDataTable, ModelTable):
    """Validated at construction; device / dtype / run_dir resolved (nothing stays "auto")."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("hf_checkpoint")
    @classmethod
    def _hf_dir(cls, v: Path) -> Path:
        if not (v / "config.json").is_file():
            raise ValueError(f"--hf-checkpoint {v} is not a local Hugging Face model directory (no config.json)")
        return v.absolute()

    @field_validator("sft_data")
    @classmethod
    def _data(cls, v: Path) -> Path:
        if not v.is_file() or v.suffix.lower() not in (".jsonl", ".json"):
            raise ValueError(f"--sft-data {v} is not an existing JSONL file")
        return v.absolute()

    @model_validator(mode="after")
    def _resolve(self) -> SFTConfig:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.global_batch_size % self.actor_num_gpus_per_node:
            raise ValueError(f"--global-batch-size {self.global_batch_size} must be a multiple of "
                             f"--actor-num-gpus-per-node {self.actor_num_gpus_per_node}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) is above --lr ({self.lr})")
        if self.device == "auto":
            import torch

            put("device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.dtype == "auto":
            put("dtype", "bfloat16" if self.device == "cuda" else "float32")
        if self.max_tokens_per_micro_batch is None:  # as milepost train: docs/training_speed.md
            put("max_tokens_per_micro_batch", 16384 if self.device == "cuda" else 4096)
        put("run_dir", (self.run_dir or default_run_dir("sft")).expanduser().absolute())
        return self

    def write_resolved(self) -> Path:
        """Every setting to <run_dir>/config.resolved.toml (loadable by load_sft_config); its path."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / RESOLVED_NAME
        tmp = path.with_suffix(".toml.tmp")
        tmp.write_text(dump_toml(self, TABLE_OF, f"Resolved settings of this SFT run; rerun with\n  milepost sft {path}"))
        os.replace(tmp, path)
        return path


def load_sft_config(recipe: Path | str | None, overrides: list[str] | None = None) -> SFTConfig:
    """The validated SFT config of `recipe` (TOML or None) then `overrides`; ConfigError naming every fault."""
    values: dict[str, Any] = {}
    if recipe is not None:
        values.update(read_recipe(Path(recipe), TABLE_OF))
    values.update(parse_overrides(SFTConfig, list(overrides or [])))
    if values.get("run_dir") is None and recipe is not None:
        values["run_dir"] = default_run_dir(Path(recipe).stem)
    try:
        return validate_strict(SFTConfig, values)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
