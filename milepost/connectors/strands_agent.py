"""Strands agents (`--agent strands:MODULE:FACTORY`, `milepost[strands]`) driving the session server
through Strands' own OpenAI model provider.

FACTORY(model) returns a `strands.Agent` built on the given `OpenAIModel` (its tools, system
prompt, ...). Each trajectory: a fresh agent on a model whose client points at the trajectory's
session, invoked with the prompt's text; every model call (tool rounds included) is recorded as
tokens. The run's `--reward-fn` grades the sample, whose `response` is the agent's final text.
An agent that raises or runs past `--env-timeout-s` fails its episode (its group is not
trained on).
At start `--agent` becomes an agent and generate fn and a reward fn wrapping the run's one,
each named by import path (the factory with its time limit, and the reward path, hex-encoded
in the attribute names, so they need no other setting). docs/environments.md.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Awaitable, Callable
from typing import Any

from milepost.auth import client_headers
from milepost.connectors.episodes import ERROR_KEY, run_episode
from milepost.connectors.extras import MissingExtraError, require
from milepost.data.source import PromptItem
from milepost.plugins import load_callable
from milepost.rollout.layers import (
    AgentContext,
    AgentOutcome,
    GenerateContext,
    agent_generate,
)
from milepost.rollout.rewards import RewardFn, load_reward_fn
from milepost.types import Sample

TEXT_KEY = "agent_text"  # metadata: the agent's final text
_AGENT, _REWARD = "agent_", "reward_"  # attribute prefixes; the rest is the hex of a path

if importlib.util.find_spec("strands") is None:  # refused at start, naming the extra
    raise MissingExtraError("the Strands connector needs the 'strands-agents' package; "
                            "install it with: pip install 'milepost[strands]'")


def _hex(text: str) -> str:
    return text.encode().hex()


def settings_for(target: str, reward_fn: str, timeout_s: float = 300.0) -> dict[str, str]:
    """What `--agent strands:TARGET` stands for, given the run's reward fn and episode time limit
    (the factory is imported here, so a wrong path stops the run at start, naming --agent)."""
    load_callable(target, f"--agent strands:{target}")
    return {"agent_function_path": f"{__name__}:{_AGENT}{_hex(f'{target}|{timeout_s!r}')}",
            "custom_generate_function_path": f"{__name__}:generate",
            "reward_fn": f"{__name__}:{_REWARD}{_hex(reward_fn)}"}


def strands_agent_fn(factory: Callable[[Any], Any], *, timeout_s: float = 300.0,
                     ) -> Callable[[AgentContext], Awaitable[AgentOutcome]]:
    """An agent fn running `factory(model)`'s Strands agent on each trajectory's session."""

    async def agent(ctx: AgentContext) -> AgentOutcome:
        async def episode() -> tuple[Any, dict[str, Any]]:
            from openai import AsyncOpenAI

            models = require("strands.models.openai", "strands", "the Strands connector")
            key = client_headers().get("Authorization", "Bearer milepost").split(" ", 1)[1]
            # Strands leaves an injected client open; ctx.http outlives the episode.
            client = AsyncOpenAI(base_url=ctx.base_url, api_key=key, http_client=ctx.http,
                                 max_retries=0)
            model = models.OpenAIModel(client=client, model_id="milepost",
                                       params={"max_tokens": ctx.max_new_tokens})
            result = await factory(model).invoke_async(prompt_text(ctx.item.prompt))
            return 0.0, {TEXT_KEY: str(result).strip(), "strands_stop": str(result.stop_reason)}

        out = await run_episode(episode(), timeout_s=timeout_s, what="strands agent")
        return AgentOutcome(reward=None, metadata=out.metadata)  # the run's reward fn grades

    return agent


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """The text an agent is invoked with: the prompt, or a chat prompt's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"]
    if not users:
        raise ValueError("a chat prompt for a Strands agent needs a user message")
    return str(users[-1]["content"])


async def generate(ctx: GenerateContext, item: PromptItem, index: int) -> Sample | list[Sample]:
    """The agent layer; each sample's `response` is the agent's final text (for --reward-fn)."""
    got = await agent_generate(ctx, item, index)
    for s in got if isinstance(got, list) else [got]:
        s.response = s.metadata.get(TEXT_KEY, s.response)
    return got


def wrap_reward(reward_fn: RewardFn) -> RewardFn:
    """The run's reward fn, except that a failed episode raises with its reason."""

    def reward(sample: Sample) -> Any:
        error = sample.metadata.get(ERROR_KEY)
        if error is not None:
            raise RuntimeError(error)
        return reward_fn(sample)

    reward.__name__ = getattr(reward_fn, "__name__", "reward")
    return reward


def __getattr__(name: str) -> Any:
    """`agent_<hex of module:factory>` and `reward_<hex of the run's reward fn>` (settings_for)."""
    for prefix, make in ((_AGENT, _agent_of), (_REWARD, _reward_of)):
        if name.startswith(prefix):
            try:
                target = bytes.fromhex(name[len(prefix):]).decode()
            except ValueError:
                break
            return make(target)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _agent_of(spec: str) -> Callable[[AgentContext], Awaitable[AgentOutcome]]:
    target, _, timeout_s = spec.partition("|")
    return strands_agent_fn(load_callable(target, f"--agent strands:{target}"),
                            timeout_s=float(timeout_s or 300.0))


def _reward_of(path: str) -> RewardFn:
    return wrap_reward(load_reward_fn(path))
