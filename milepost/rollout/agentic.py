"""What `milepost train` runs when a rollout layer is plugged in (`--rollout-function-path`,
`--custom-generate-function-path`, `--agent-function-path`): the chosen layers, and the session
server (rank 0, a loopback thread) when the run uses one. With several engines the session
server talks to the router, and every turn carries its session id as the routing key.

The driver hands over the prompts it drew; a rollout fn that owns its task set may ignore them.
Under `--fully-async` the rollout worker draws the prompts and groups the trajectories, and runs
the generate fn (and agent fn) of `for_worker` for each trajectory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import httpx

from milepost.auth import client_headers
from milepost.config import TrainConfig
from milepost.config_rules import session_server_enabled
from milepost.data.source import PromptItem
from milepost.http_tls import tls_context
from milepost.lora.settings import POLICY_ADAPTER
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import RolloutResult, SamplingSettings
from milepost.rollout.layers import (
    GenerateContext,
    RolloutContext,
    as_samples,
    default_generate,
    default_rollout,
    load_layer,
)
from milepost.rollout.rewards import RewardFn
from milepost.rollout.scheduler import TrajectoryFn
from milepost.types import Sample


def pad_to_optimizer_steps(samples: list[Sample], global_batch_size: int) -> list[Sample]:
    """`samples` plus zero-weight copies up to a whole number of optimizer steps.

    A branching session may yield several sequences (`--session-leaf-selection all`), so a step's
    sample count varies, while the trainer cuts a step into optimizer steps of exactly
    `global_batch_size` samples. Each filler copies a real sample with loss mask 0, reward 0 and
    a group of its own (advantage 0): under token_mean (the only aggregation allowed with
    several leaves) it adds nothing to the loss or its gradient."""
    short = -len(samples) % global_batch_size
    fillers = []
    for k in range(short):
        src = samples[k % len(samples)]
        fill = Sample.from_dict(src.to_dict())
        fill.loss_mask = [0] * fill.response_length
        fill.reward = 0.0
        fill.group_index = -1 - k  # alone in its group: its advantage is 0
        fill.metadata = {"padding_for": [src.group_index, src.index]}
        fillers.append(fill)
    return samples + fillers


def rollout_layers_enabled(cfg: TrainConfig) -> bool:
    return any(p is not None for p in (cfg.rollout_function_path,
                                       cfg.custom_generate_function_path,
                                       cfg.agent_function_path))


class _Prompts:
    """The prompts the driver drew for one call, as a data source."""

    def __init__(self, items: list[PromptItem]) -> None:
        self._items = deque(items)

    def next_batch(self, n: int) -> list[PromptItem]:
        return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def requeue(self, items: Iterable[PromptItem]) -> None:
        self._items.extendleft(reversed(list(items)))

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class AgenticRollout:
    def __init__(self, cfg: TrainConfig, engine_urls: list[str], router_url: str | None,
                 sampling: SamplingSettings) -> None:
        self.cfg = cfg
        self.engine_urls = engine_urls
        self.sampling = sampling
        self.rollout_fn = load_layer(cfg.rollout_function_path, "--rollout-function-path") \
            or default_rollout
        self.generate_fn = load_layer(cfg.custom_generate_function_path,
                                      "--custom-generate-function-path") or default_generate
        self.agent_fn = load_layer(cfg.agent_function_path, "--agent-function-path")
        # LoRA RL: every engine request of the layers (the context's clients, the session
        # server's) names the trained adapter; multi-LoRA runs refuse these layers.
        self.lora_path = POLICY_ADAPTER if cfg.lora_rank else None
        self.session_server = None
        if session_server_enabled(cfg):
            from milepost.session.runner import SessionServerThread
            from milepost.session.service import SessionSettings

            self.session_server = SessionServerThread(
                cfg.hf_checkpoint, router_url or engine_urls[0],
                family=cfg.session_model_family, matcher=cfg.session_matcher, api_key=cfg.api_key,
                settings=SessionSettings(mode=cfg.session_mode, divergence=cfg.session_divergence,
                                         sampling=sampling.to_params(),
                                         enforce_sampling=True,
                                         return_routed_experts=cfg.use_rollout_routing_replay,
                                         leaf_selection=cfg.session_leaf_selection),
                lora_path=self.lora_path)

    async def rollout(self, items: list[PromptItem], group_index_start: int, reward_fn: Any,
                      group_reward_fn: Any) -> RolloutResult:
        cfg = self.cfg
        clients = [EngineClient(url, lora_path=self.lora_path) for url in self.engine_urls]
        http = httpx.AsyncClient(timeout=None, headers=client_headers(), verify=tls_context())  # to the session server
        url = self.session_server.url if self.session_server is not None else None

        def context(g: int) -> GenerateContext:
            return GenerateContext(clients=clients, sampling=self.sampling, group_index=g,
                                   session_url=url, agent_fn=self.agent_fn, http=http,
                                   return_routed_experts=cfg.use_rollout_routing_replay)

        try:
            return await self.rollout_fn(RolloutContext(
                data=_Prompts(items), num_groups=len(items),
                n_samples_per_prompt=cfg.n_samples_per_prompt,
                group_index_start=group_index_start, generate_fn=self.generate_fn,
                generate_context=context, reward_fn=reward_fn, group_reward_fn=group_reward_fn,
                max_concurrency=cfg.rollout_max_concurrency))
        finally:
            await http.aclose()
            for c in clients:
                await c.aclose()

    def for_worker(self, reward_fn: RewardFn | None) -> tuple[TrajectoryFn, RewardFn]:
        """What the fully-async rollout worker plugs in: a trajectory fn running this run's
        generate fn (and agent fn, through the session server) on the worker's event loop, and
        the reward fn (without one, the rewards the agent/generate fn set stand, as in the sync
        loop). A rollout fn owns its data and grouping, so it has no place under the worker."""
        if self.cfg.rollout_function_path is not None:
            raise ValueError("--rollout-function-path owns data and grouping; the fully-async "
                             "worker owns them instead (drop one of them)")
        url = self.session_server.url if self.session_server is not None else None
        cfg = self.cfg

        async def trajectory(client: EngineClient, item: PromptItem, index: int,
                             group_index: int) -> list[Sample]:
            # Its own HTTP client: the worker's loop is not the one this object was made on.
            async with httpx.AsyncClient(timeout=None, headers=client_headers(), verify=tls_context()) as http:
                ctx = GenerateContext(clients=[client], sampling=self.sampling,
                                      group_index=group_index, session_url=url,
                                      agent_fn=self.agent_fn, http=http,
                                      return_routed_experts=cfg.use_rollout_routing_replay)
                return as_samples(await self.generate_fn(ctx, item, index))

        return trajectory, reward_fn or _own_reward

    def close(self) -> None:
        if self.session_server is not None:
            self.session_server.close()


def _own_reward(sample: Sample) -> float:
    """The reward the agent or generate fn set (runs without a reward fn)."""
    if sample.reward is None:
        raise ValueError("no reward fn and the generate/agent fn set no reward (pass --reward-fn, "
                         "or return AgentOutcome(reward=...))")
    return float(sample.reward)
