"""`--env KIND:NAME`: an environment's prompts and grader as one setting (docs/environments.md).

At start (`milepost train`, before the resolved settings are written) the environment's prompts
are written into the run directory and the run continues as `--prompt-data FILE --reward-fn
GRADER`, so ranks, resumes and the resolved settings see ordinary settings.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from milepost.config import TrainConfig

KINDS = {"reasoning_gym": "milepost.connectors.reasoning_gym:reward"}  # kind -> its reward fn
ENV_PATTERN = re.compile(r"^(?P<kind>[a-z_]+):(?P<name>[A-Za-z0-9_]+)$")


def check_env(value: str) -> str:
    """`value` if it names a known kind and a name; a ValueError naming --env and the fix."""
    m = ENV_PATTERN.match(value)
    if m is None or m["kind"] not in KINDS:
        raise ValueError(f"--env {value!r}: give KIND:NAME with KIND one of {sorted(KINDS)}, "
                         "e.g. reasoning_gym:basic_arithmetic")
    return value


def env_refusals(env: str | None, *, prompt_data: Path | None, reward_fn: str,
                 load_rollouts: Path | None) -> list[str]:
    """The settings --env replaces, when given with it (each message names both and the fix)."""
    if env is None:
        return []
    p = []
    if prompt_data is not None:
        p.append(f"--env {env} makes the prompts: drop --prompt-data {prompt_data}")
    if reward_fn != "exact_match":  # the default: anything else was asked for
        p.append(f"--env {env} grades with the task's own scorer: drop --reward-fn {reward_fn}")
    if load_rollouts is not None:
        p.append(f"--env {env} with --load-rollouts: saved rollouts need no prompts; drop --env")
    return p


def env_prompts_path(cfg: TrainConfig) -> Path:
    kind, _, name = str(cfg.env).partition(":")
    return Path(cfg.run_dir) / f"env-{kind}-{name}-seed{cfg.rollout_seed}-n{cfg.env_size}.jsonl"


def resolve_env(cfg: TrainConfig) -> TrainConfig:
    """`cfg` unchanged without --env; else the env's prompts written to the run directory and a
    copy of `cfg` that reads them (`prompt_data`) and grades with the env's reward fn. Raises
    ValueError (unknown task, bad config) or ImportError (the extra is missing), naming --env."""
    if cfg.env is None:
        return cfg
    from milepost.connectors import reasoning_gym  # the one kind so far

    kind, _, name = cfg.env.partition(":")
    path = env_prompts_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        reasoning_gym.write_prompts(path, name, size=cfg.env_size, seed=cfg.rollout_seed)
    except ValueError as e:
        raise ValueError(f"--env {cfg.env}: {e}") from e
    return cfg.model_copy(update={"env": None, "prompt_data": path, "reward_fn": KINDS[kind]})
