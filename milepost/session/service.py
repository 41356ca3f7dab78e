"""The session server's turn logic, apart from HTTP: attach a request to its session, build the
prompt from the stored ids plus the tokenized suffix, generate on the engine with the session id
as the routing key, read the reply back into a message, store the turn.

Linear sessions run one turn at a time (the tail must not move under a request); branching
sessions generate concurrently and only attach and store under the session's lock.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from milepost.rollout.client import EngineClient, GenerateOutput
from milepost.session.families import Message
from milepost.session.matchers import Matcher
from milepost.session.render import Renderer, normalize_messages
from milepost.session.sequence import build_samples
from milepost.session.store import Session, SessionConflict, SessionMode, Turn
from milepost.types import Sample


class SessionNotFound(KeyError):
    pass


class GenerationAborted(RuntimeError):
    """The engine aborted the turn (e.g. a pause in abort mode): nothing was stored."""


@dataclass
class SessionSettings:
    """mode / matcher: report 2.4.1 / 2.4.2. sampling: SGLang sampling_params for every turn;
    with enforce_sampling the run's values win over the harness's (RL needs the temperature the
    trainer assumes), and max_tokens may only lower max_new_tokens. return_routed_experts: ask the
    engine for routed experts (MoE + R3)."""

    mode: SessionMode = "linear"
    sampling: dict[str, Any] = field(default_factory=lambda: {"max_new_tokens": 256})
    enforce_sampling: bool = False
    return_routed_experts: bool = False


@dataclass
class TurnResult:
    turn: Turn
    reply: Message
    output: GenerateOutput
    overhead_s: float
    generate_s: float = 0.0


class SessionService:
    def __init__(self, renderer: Renderer, client: EngineClient, matcher: Matcher,
                 settings: SessionSettings) -> None:
        self.renderer = renderer
        self.client = client
        self.matcher = matcher
        self.settings = settings
        self.sessions: dict[str, Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def create(self) -> Session:
        sid = uuid.uuid4().hex
        self.sessions[sid] = Session(sid, self.settings.mode, self.matcher)
        self._locks[sid] = asyncio.Lock()
        return self.sessions[sid]

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionNotFound(f"unknown session {session_id!r} (create one with POST "
                                  f"/sessions; deleted sessions are gone)") from None

    def delete(self, session_id: str) -> None:
        self.get(session_id)
        del self.sessions[session_id]
        self._locks.pop(session_id, None)

    def samples(self, session_id: str, leaf_ids: list[int] | None = None) -> list[Sample]:
        session = self.get(session_id)
        leaves = session.leaves()
        if leaf_ids is not None:
            by_id = {t.id: t for t in leaves}
            missing = [i for i in leaf_ids if i not in by_id]
            if missing:
                raise SessionConflict(f"leaves {missing} are not leaves of session {session_id} "
                                      f"(its leaves: {sorted(by_id)})")
            leaves = [by_id[i] for i in leaf_ids]
        return build_samples(session, leaves)

    def sampling_params(self, request: dict[str, Any]) -> dict[str, Any]:
        base = dict(self.settings.sampling)
        if self.settings.enforce_sampling:
            if request.get("max_new_tokens") is not None:
                base["max_new_tokens"] = min(base.get("max_new_tokens", 1 << 30),
                                             request["max_new_tokens"])
            return base
        return {**base, **{k: v for k, v in request.items() if v is not None}}

    async def turn(self, session_id: str, messages: list[Message], tools: list[dict] | None,
                   request_sampling: dict[str, Any]) -> TurnResult:
        start = time.perf_counter()
        session = self.get(session_id)
        lock = self._locks[session_id]
        messages = normalize_messages(messages)
        if self.settings.mode == "linear":
            async with lock:
                return await self._turn(session, messages, tools, request_sampling, start, None)
        return await self._turn(session, messages, tools, request_sampling, start, lock)

    async def _turn(self, session: Session, messages: list[Message], tools: list[dict] | None,
                    request_sampling: dict[str, Any], start: float,
                    lock: asyncio.Lock | None) -> TurnResult:
        r = self.renderer
        if lock is not None:
            await lock.acquire()
        try:
            attach = session.attach(messages, tools)
        finally:
            if lock is not None:
                lock.release()
        at = attach.at
        history = at.messages + attach.new_messages  # stored messages win where they matched
        if at.parent is None:
            suffix = r.first_prompt(history, tools)
        else:
            suffix = r.suffix_ids(at.rendered, at.ended_with_eot, history, tools)
        params = self.sampling_params(request_sampling)
        gen_start = time.perf_counter()
        out = await self.client.generate(
            at.ids + suffix, params, return_logprob=True,
            return_routed_experts=self.settings.return_routed_experts, routing_key=session.id)
        gen_s = time.perf_counter() - gen_start
        if out.finish_type == "abort":
            raise GenerationAborted(f"the engine aborted this turn ({out.finish_reason}); nothing "
                                    f"was stored, the request can be sent again")
        reply = r.parse_output(out.output_ids).message()
        stored = history + [reply]
        rendered = r.cut_after_last_turn(r.render(stored, tools, add_generation_prompt=False))
        if lock is not None:
            await lock.acquire()
        try:
            turn = session.add_turn(
                at, stored, tools, prompt_ids=suffix, output_ids=out.output_ids,
                logprobs=out.logprobs, weight_versions=out.weight_versions,
                weight_version=out.weight_version, routed_experts=out.routed_experts,
                finish_reason=out.finish_reason, rendered=rendered,
                ended_with_eot=bool(out.output_ids) and out.output_ids[-1] == r.eot_id,
                cached_tokens=out.cached_tokens)
        finally:
            if lock is not None:
                lock.release()
        turn.overhead_s = time.perf_counter() - start - gen_s
        return TurnResult(turn, reply, out, turn.overhead_s, gen_s)
