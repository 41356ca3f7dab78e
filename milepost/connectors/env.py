"""`--env KIND:NAME`: an environment's prompts and grader as one setting (docs/environments.md).

At start (`milepost train`, before the resolved settings are written) the environment's prompts
are written into the run directory and the run continues as `--prompt-data FILE --reward-fn
GRADER` (plus, for environments that run episodes, the connector's agent and generate fns), so
ranks, resumes and the resolved settings see ordinary settings.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from milepost.config import TrainConfig

# kind -> its connector module: `write_prompts(path, name, size=, seed=, ...)` and SETTINGS, the
# settings the kind stands for (a reward fn; an agent and generate fn for episode environments)
KINDS = {"reasoning_gym": "milepost.connectors.reasoning_gym",
         "verifiers": "milepost.connectors.verifiers_env",
         "openenv": "milepost.connectors.openenv_env"}
EPISODE_KINDS = {"verifiers", "openenv"}  # run through the session server: they need a model family
AGENT_KINDS = {"strands": "milepost.connectors.strands_agent"}  # --agent KIND:MODULE:FACTORY
AGENT_PATTERN = re.compile(r"^(?P<kind>[a-z_]+):(?P<target>[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
ENV_PATTERN = re.compile(r"^(?P<kind>[a-z_]+):(?P<name>[A-Za-z0-9_.\-]+)$")


def check_env(value: str) -> str:
    """`value` if it names a known kind and a name; a ValueError naming --env and the fix."""
    m = ENV_PATTERN.match(value)
    if m is None or m["kind"] not in KINDS:
        raise ValueError(f"--env {value!r}: give KIND:NAME with KIND one of {sorted(KINDS)}, "
                         "e.g. reasoning_gym:basic_arithmetic or verifiers:my_env")
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


def episode_env_refusals(c: TrainConfig) -> list[str]:
    """An --env whose episodes run through the session server, or an --agent: what it needs
    and what it replaces."""
    p: list[str] = []
    env_kind = None if c.env is None else c.env.partition(":")[0]
    if c.agent is not None:
        m = AGENT_PATTERN.match(c.agent)
        if m is None or m["kind"] not in AGENT_KINDS:
            p.append(f"--agent {c.agent!r}: give KIND:MODULE:FACTORY with KIND one of "
                     f"{sorted(AGENT_KINDS)}, e.g. strands:my.agents:make_agent")
        if env_kind in EPISODE_KINDS:
            p.append(f"--agent {c.agent} with --env {c.env}: that environment runs its own "
                     "episodes; drop one of them")
    what = f"--agent {c.agent}" if c.agent is not None else (
        f"--env {c.env}" if env_kind in EPISODE_KINDS else None)
    if what is None:
        return p
    for flag, value in (("--agent-function-path", c.agent_function_path),
                        ("--custom-generate-function-path", c.custom_generate_function_path),
                        ("--rollout-function-path", c.rollout_function_path)):
        if value is not None:
            p.append(f"{what} runs its episodes with the connector's own rollout layers: "
                     f"drop {flag} {value}")
    if c.session_model_family is None:
        p.append(f"{what} runs its episodes through the session server: give "
                 "--session-model-family (the checkpoint's chat template family)")
    return p


def env_prompts_path(cfg: TrainConfig) -> Path:
    kind, _, name = str(cfg.env).partition(":")
    return Path(cfg.run_dir) / f"env-{kind}-{name}-seed{cfg.rollout_seed}-n{cfg.env_size}.jsonl"


def resolve_env(cfg: TrainConfig) -> TrainConfig:
    """`cfg` unchanged without --env; else the env's prompts written to the run directory and a
    copy of `cfg` that reads them (`prompt_data`) and grades with the env's reward fn. Raises
    ValueError (unknown task, bad config) or ImportError (the extra is missing), naming --env."""
    if cfg.agent is not None:  # after --env, whose reward fn the agent's grading wraps
        kind, _, target = cfg.agent.partition(":")
        cfg = resolve_env(cfg.model_copy(update={"agent": None}))
        connector = importlib.import_module(AGENT_KINDS[kind])  # ImportError names the extra
        return cfg.model_copy(update=connector.settings_for(target, cfg.reward_fn,
                                                             cfg.env_timeout_s))
    if cfg.env is None:
        return cfg
    kind, _, name = cfg.env.partition(":")
    connector = importlib.import_module(KINDS[kind])  # ImportError names the extra
    path = env_prompts_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {} if kind not in EPISODE_KINDS else {"timeout_s": cfg.env_timeout_s}
    try:
        n = connector.write_prompts(path, name, size=cfg.env_size, seed=cfg.rollout_seed, **extra)
    except ValueError as e:
        raise ValueError(f"--env {cfg.env}: {e}") from e
    if n == 0:
        raise ValueError(f"--env {cfg.env}: the environment has no prompts")
    stands_for = connector.settings(name) if hasattr(connector, "settings") else connector.SETTINGS
    return cfg.model_copy(update={"env": None, "prompt_data": path, **stands_for})
