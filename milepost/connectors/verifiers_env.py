"""Verifiers environments (`--env verifiers:NAME`, `milepost[verifiers]`): their datasets as
prompts, their rollouts run against the session server, their rubrics as the reward.

NAME is an installed environment module (`verifiers.load_environment(NAME)`), single- or
multi-turn. Each trajectory runs the environment's own `rollout` with a verifiers OpenAI client
pointed at its session, so every model call is recorded as tokens; the rubric scores the finished
state. Rubrics with group-level reward functions are refused (each trajectory is scored alone).
Built against verifiers 0.3.1 (its legacy `vf.Environment` API); docs/environments.md.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from milepost.connectors.episodes import (
    DEFAULT_TIMEOUT_S,
    failed,
    run_episode,
    timeout_of,
)
from milepost.connectors.extras import MissingExtraError, require
from milepost.rollout.layers import AgentContext, AgentOutcome

META_KEY = "verifiers"
SETTINGS = {"custom_generate_function_path": "milepost.connectors.episodes:env_generate",
            "reward_fn": "milepost.connectors.episodes:env_reward"}
_PRELOAD = "agent_"  # + the hex of an environment name: `agent`, with that environment loaded

# `--agent-function-path milepost.connectors.verifiers_env:agent` imports this at start: a run
# without the package is refused then, naming the extra.
if importlib.util.find_spec("verifiers") is None:
    raise MissingExtraError("the Verifiers connector needs the 'verifiers' package; "
                            "install it with: pip install 'milepost[verifiers]'")


def _vf() -> Any:
    return require("verifiers", "verifiers", "the Verifiers connector")


@functools.lru_cache(maxsize=16)
def _environment(name: str, args_json: str) -> Any:
    try:
        env = _vf().load_environment(name, **json.loads(args_json))
    except (ValueError, RuntimeError, TypeError) as e:  # what load_environment raises
        raise ValueError(f"verifiers environment {name!r}: {e}") from e
    if getattr(env.rubric, "has_group_rewards", False):
        raise ValueError(f"verifiers environment {name!r}: its rubric has group-level reward "
                         "functions, which milepost does not run (each trajectory is scored alone)")
    env._stop_conditions.append(milepost_turn_truncated)
    return env


async def milepost_turn_truncated(state: Any) -> bool:
    """A stop condition added to every environment: a turn cut at the length limit ends the
    episode, since the session server cannot extend it (the next turn would be refused, 409)."""
    trajectory = state.get("trajectory") or []
    return bool(trajectory) and bool(trajectory[-1].get("is_truncated"))


def settings(name: str) -> dict[str, str]:
    """What `--env verifiers:NAME` stands for. The agent fn's name carries the environment, so
    loading the agent fn at start (on the main thread) loads the environment: verifiers installs
    signal handlers when an environment is made, which only the main thread may do (the
    fully-async rollout worker runs episodes on a thread of its own)."""
    return {**SETTINGS, "agent_function_path": f"{__name__}:{_PRELOAD}{name.encode().hex()}"}


def __getattr__(attr: str) -> Any:
    if attr.startswith(_PRELOAD):
        try:
            name = bytes.fromhex(attr[len(_PRELOAD):]).decode()
        except ValueError:
            pass
        else:
            environment(name)
            return agent
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def environment(name: str, args: dict[str, Any] | None = None) -> Any:
    """The loaded environment (once per process and arguments)."""
    return _environment(name, json.dumps(args or {}, sort_keys=True))


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda o: o.model_dump()
                                 if hasattr(o, "model_dump") else str(o)))


def prompt_rows(name: str, *, size: int, seed: int, args: dict[str, Any] | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict[str, Any]]:
    """`size` rows of the environment's dataset (shuffled with `seed`; fewer if it is smaller),
    each with the verifiers input its rollout starts from in `metadata["verifiers"]`."""
    env = environment(name, args)
    try:
        ds = env.get_dataset(n=size, seed=seed)
    except ValueError:  # an environment with an evaluation set only
        ds = env.get_eval_dataset(n=size, seed=seed)
    rows = []
    for row in ds:
        row = _jsonable(dict(row))
        meta = {"env": name, "args": args or {}, "input": row, "timeout_s": timeout_s}
        rows.append({"prompt": row["prompt"], "label": row.get("answer"),
                     "metadata": {META_KEY: meta}})
    return rows


def write_prompts(path: Path, name: str, *, size: int, seed: int,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    rows = prompt_rows(name, size=size, seed=seed, timeout_s=timeout_s)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


async def agent(ctx: AgentContext) -> AgentOutcome:
    """One verifiers rollout of the item's input against this trajectory's session, scored by
    the environment's rubric (`metadata["verifiers_metrics"]` keeps its metrics)."""
    meta = ctx.item.metadata.get(META_KEY)
    if not isinstance(meta, dict):
        return failed(f"the prompt has no metadata[{META_KEY!r}]; make the prompts with "
                      "--env verifiers:NAME (keep --metadata-key metadata)")
    name = meta["env"]

    async def episode() -> tuple[Any, dict[str, Any]]:
        from openai import AsyncOpenAI

        env = environment(name, meta.get("args"))
        oai = AsyncOpenAI(base_url=ctx.base_url, api_key="milepost", http_client=ctx.http,
                          max_retries=0)
        state = await env.rollout(meta["input"], _client_class()(oai), "milepost",
                                  {"max_tokens": ctx.max_new_tokens})
        if state.get("error") is not None:
            raise RuntimeError(f"the rollout stopped on {_describe(state['error'])}")
        await env.rubric.score_rollout(state)
        return state["reward"], {"verifiers_metrics": _jsonable(state.get("metrics") or {})}

    return await run_episode(episode(), timeout_s=timeout_of(meta), what=f"verifiers:{name}")


@functools.cache
def _client_class() -> type:
    """verifiers' chat client, except that an empty reply is a reply. verifiers refuses one
    (EmptyModelResponseError: from an API model it means a provider failure); from the policy
    being trained it is an answer like any other, for the rubric to grade, and refusing it would
    drop exactly the groups where the model says nothing."""
    vf = _vf()

    class SessionClient(vf.OpenAIChatCompletionsClient):
        async def raise_from_native_response(self, response: Any) -> None:
            try:
                await super().raise_from_native_response(response)
            except vf.EmptyModelResponseError:
                if response is None or not response.choices:
                    raise

    return SessionClient


def _describe(error: BaseException) -> str:
    """verifiers wraps what failed (e.g. ModelError from the session server's 409): name both."""
    cause = error.__cause__ or error.__context__
    return f"{type(error).__name__}({error})" + (f" <- {type(cause).__name__}: {cause}"
                                                  if cause is not None else "")
