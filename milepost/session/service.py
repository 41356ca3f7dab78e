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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from milepost.rollout.client import EngineClient, GenerateOutput
from milepost.session.divergence import Divergence, DivergencePolicy, warn
from milepost.session.families import Message
from milepost.session.matchers import Matcher
from milepost.session.render import Renderer, normalize_messages
from milepost.session.selection import load_leaf_selector, select_leaves
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
    engine for routed experts (MoE + R3). leaf_selection: latest | all | module.sub:fn.
    divergence: what a linear session does with a request that replays its history differently
    (divergence.py): reject (409) | rollback (to the longest stored prefix, recorded)."""

    mode: SessionMode = "linear"
    divergence: DivergencePolicy = "reject"
    sampling: dict[str, Any] = field(default_factory=lambda: {"max_new_tokens": 256})
    enforce_sampling: bool = False
    return_routed_experts: bool = False
    leaf_selection: str = "all"  # which leaves /samples returns when none are named (selection.py)


@dataclass
class PreparedTurn:
    """A request attached to its session, with its prompt built, not yet generated."""

    session: Session
    at: Turn  # the checkpoint it extends
    history: list[Message]  # the messages of the prompt (stored ones where they matched)
    tools: list[dict] | None
    suffix: list[int]  # ids appended after `at` (mask 0)
    params: dict[str, Any]  # SGLang sampling_params
    start: float
    lock: asyncio.Lock  # the session's
    holds_lock: bool  # linear: held from prepare until the turn is stored or dropped
    prompt_text: str  # the template's rendering of `history` + generation prompt
    divergence: Divergence | None = None  # rollback / fork, recorded when the turn is stored
    released: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.at.ids + self.suffix


@dataclass
class TurnResult:
    turn: Turn
    reply: Message
    output: GenerateOutput
    overhead_s: float
    generate_s: float = 0.0
    divergence: Divergence | None = None


class SessionService:
    def __init__(self, renderer: Renderer, client: EngineClient, matcher: Matcher,
                 settings: SessionSettings) -> None:
        self.renderer = renderer
        self.client = client
        self.matcher = matcher
        self.settings = settings
        self.sessions: dict[str, Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.pending: dict[str, int] = {}  # turns prepared and not yet stored or dropped
        self._selector = load_leaf_selector(settings.leaf_selection)

    def create(self) -> Session:
        sid = uuid.uuid4().hex
        self.sessions[sid] = Session(sid, self.settings.mode, self.matcher,
                                     self.settings.divergence)
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
        self.pending.pop(session_id, None)

    def samples(self, session_id: str, leaf_ids: list[int] | None = None) -> list[Sample]:
        """One sample per leaf: the leaves named, or the settings' leaf selection."""
        session = self.get(session_id)
        leaves = session.leaves()
        if leaf_ids is None:
            return select_leaves(self._selector, build_samples(session, leaves))
        by_id = {t.id: t for t in leaves}
        missing = [i for i in leaf_ids if i not in by_id]
        if missing:
            raise SessionConflict(f"leaves {missing} are not leaves of session {session_id} "
                                  f"(its leaves: {sorted(by_id)})")
        return build_samples(session, [by_id[i] for i in leaf_ids])

    def sampling_params(self, request: dict[str, Any]) -> dict[str, Any]:
        base = dict(self.settings.sampling)
        if self.settings.enforce_sampling:
            if request.get("max_new_tokens") is not None:
                base["max_new_tokens"] = min(base.get("max_new_tokens", 1 << 30),
                                             request["max_new_tokens"])
            return base
        return {**base, **{k: v for k, v in request.items() if v is not None}}

    async def prepare(self, session_id: str, messages: list[Message], tools: list[dict] | None,
                      request_sampling: dict[str, Any],
                      template_kwargs: dict[str, Any] | None = None) -> PreparedTurn:
        """Attach the request and build its prompt; every refusal (409, 422) happens here,
        before any engine call. A linear session's lock is held from here until the turn is
        stored or dropped (`run` / `stream` release it)."""
        start = time.perf_counter()
        session = self.get(session_id)
        lock = self._locks[session_id]
        messages = normalize_messages(messages)
        await lock.acquire()
        try:
            try:
                attach = session.attach(messages, tools,
                                        self._reasoning_probe(tools, template_kwargs))
            except SessionConflict as e:
                if e.divergence is not None:
                    warn(session.id, e.divergence)
                raise
            at = attach.at
            if attach.divergence is not None:
                warn(session.id, attach.divergence)
            history = at.messages + attach.new_messages  # stored messages win where they matched
            r = self.renderer
            if at.parent is None:
                prompt_text = r.prompt_text(history, tools, template_kwargs)
                suffix = r.encode(prompt_text)
            else:
                prompt_text, suffix_text = r.prompt_and_suffix(at.rendered, at.ended_with_eot,
                                                               history, tools, template_kwargs)
                suffix = r.encode(suffix_text)
        except BaseException:
            lock.release()
            raise
        holds_lock = self.settings.mode == "linear"
        if not holds_lock:  # branching: turns of one session generate concurrently
            lock.release()
        self.pending[session_id] = self.pending.get(session_id, 0) + 1
        return PreparedTurn(session, at, history, tools, suffix,
                            self.sampling_params(request_sampling), start, lock, holds_lock,
                            prompt_text, attach.divergence)

    def _reasoning_probe(self, tools: list[dict] | None, template_kwargs: dict[str, Any] | None,
                         ) -> Callable[[list[Message], int, str], bool]:
        """Does the template read the reasoning of message i, in the request's context? Renders
        only when a replay omits a stored reasoning (the base rendering once per request)."""
        r = self.renderer
        base: list[str] = []

        def reads(messages: list[Message], i: int, reasoning: str) -> bool:
            if not base:
                base.append(r.render(messages, tools, True, template_kwargs))
            probe = list(messages)
            probe[i] = {**probe[i], "reasoning_content": reasoning}
            return r.render(probe, tools, True, template_kwargs) != base[0]

        return reads

    async def turn(self, session_id: str, messages: list[Message], tools: list[dict] | None,
                   request_sampling: dict[str, Any],
                   template_kwargs: dict[str, Any] | None = None) -> TurnResult:
        """One whole turn: prepare, generate, store."""
        return await self.run(await self.prepare(session_id, messages, tools, request_sampling,
                                                 template_kwargs))

    async def run(self, turn: PreparedTurn) -> TurnResult:
        try:
            gen_start = time.perf_counter()
            out = await self.client.generate(
                turn.prompt_ids, turn.params, return_logprob=True,
                return_routed_experts=self.settings.return_routed_experts,
                routing_key=turn.session.id)
            return await self._store(turn, out, time.perf_counter() - gen_start)
        finally:
            self._release(turn)

    async def stream(self, turn: PreparedTurn) -> AsyncIterator[GenerateOutput | TurnResult]:
        """The engine's cumulative outputs as they come, then the stored TurnResult. Closing the
        iterator before the end (the client left) aborts the engine request and stores nothing."""
        try:
            gen_start = time.perf_counter()
            out: GenerateOutput | None = None
            chunks = self.client.generate_stream(
                turn.prompt_ids, turn.params, return_logprob=True,
                return_routed_experts=self.settings.return_routed_experts,
                routing_key=turn.session.id)
            try:
                async for out in chunks:
                    if not out.finish_reason:
                        yield out
            finally:
                await chunks.aclose()  # closes the connection: the engine aborts the request
            assert out is not None  # generate_stream raises when no finished chunk came
            yield await self._store(turn, out, time.perf_counter() - gen_start)
        finally:
            self._release(turn)

    def _release(self, turn: PreparedTurn) -> None:
        if turn.released:
            return
        turn.released = True
        sid = turn.session.id
        if sid in self.pending:  # gone if the session was deleted meanwhile
            self.pending[sid] -= 1
        if turn.holds_lock:
            turn.lock.release()

    async def _store(self, turn: PreparedTurn, out: GenerateOutput, gen_s: float) -> TurnResult:
        """Parse the finished output and write the checkpoint: the turn's only write."""
        if out.finish_type == "abort":
            raise GenerationAborted(f"the engine aborted this turn ({out.finish_reason}); nothing "
                                    f"was stored, the request can be sent again")
        r = self.renderer
        parsed = r.parse_output(out.output_ids)
        reply = parsed.message()
        stored = turn.history + [reply]
        rendered = r.stored_after(turn.prompt_text, out.output_ids)
        fields = {
            "prompt_ids": turn.suffix, "output_ids": out.output_ids, "logprobs": out.logprobs,
            "weight_versions": out.weight_versions, "weight_version": out.weight_version,
            "routed_experts": out.routed_experts, "finish_reason": out.finish_reason,
            "rendered": rendered, "cached_tokens": out.cached_tokens,
            "unparsed_tool_calls": parsed.unparsed_tool_calls,
            "ended_with_eot": bool(out.output_ids) and out.output_ids[-1] in r.eot_ids}
        if turn.holds_lock:  # linear: held since prepare
            stored_turn = turn.session.add_turn(turn.at, stored, turn.tools, turn.divergence,
                                                **fields)
        else:
            async with turn.lock:
                stored_turn = turn.session.add_turn(turn.at, stored, turn.tools,
                                                    turn.divergence, **fields)
        stored_turn.overhead_s = time.perf_counter() - turn.start - gen_s
        return TurnResult(stored_turn, reply, out, stored_turn.overhead_s, gen_s, turn.divergence)
