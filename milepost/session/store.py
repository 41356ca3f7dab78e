"""A session's stored history (report 2.4.1): a tree of turn checkpoints.

Every completed turn is a checkpoint holding the ids it appended (prompt suffix, then the model's
output ids), the output's log-probs, weight versions and routed experts, and the message path up
to and including the model's reply. A request attaches at the deepest checkpoint whose message
path its messages extend (under the session's matcher).

- linear: the request must extend the tail, or retry the tail's turn (attach at its parent, which
  replaces the tail). A request that replays a stored message differently diverges: refused (409)
  or rolled back to the longest stored prefix it replays, as the divergence policy says
  (divergence.py). One training sequence.
- branching: the tree is append-only; any attach point opens a new branch. One sequence per leaf.
Either way a turn that stopped at the length limit cannot be extended. Nothing is written until
a turn has completed, so a refused or failed request leaves the stored history as it was.
An omitted reasoning_content counts as the stored one where the template does not read it
(`reads_reasoning`, a probe the service renders with).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from milepost.session.divergence import (
    Divergence,
    DivergencePolicy,
    describe_difference,
)
from milepost.session.matchers import Matcher, omitted_reasoning
from milepost.session.render import Rendered

Message = dict[str, Any]
SessionMode = Literal["linear", "branching"]
# (request messages, index, stored reasoning) -> does the template render that message differently
# with the reasoning than without it, in the request's context?
ReasoningProbe = Callable[[list[Message], int, str], bool]


class SessionConflict(ValueError):
    """The request cannot extend this session (HTTP 409); the message says why."""

    def __init__(self, message: str, divergence: Divergence | None = None) -> None:
        super().__init__(message)
        self.divergence = divergence  # set when a replay diverged and the policy is reject


@dataclass
class Turn:
    """One checkpoint. `ids` is the whole token sequence up to the end of this turn's output."""

    id: int
    parent: Turn | None
    messages: list[Message]  # the path: every message up to and including the model's reply
    prompt_ids: list[int] = field(default_factory=list)  # appended before generating (mask 0)
    output_ids: list[int] = field(default_factory=list)  # sampled by the model (mask 1)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    weight_version: str = ""
    routed_experts: str | None = None  # base64 int32 rows for ids[:-1] as of this turn's call
    finish_reason: dict[str, Any] = field(default_factory=dict)
    rendered: Rendered | None = None  # where the turn sits in the template's text
    ended_with_eot: bool = True
    cached_tokens: int = 0
    unparsed_tool_calls: int = 0  # tool-call blocks of the output kept as text (bad JSON)
    overhead_s: float = 0.0  # the server's own time for this turn (generation excluded)
    children: list[Turn] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        return self.finish_reason.get("type") == "length"

    def path(self) -> list[Turn]:
        """The turns from the first to this one (the root excluded)."""
        out: list[Turn] = []
        node: Turn | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


@dataclass
class Attach:
    """Where a request attaches: the checkpoint `at`, and the request's messages past it."""

    at: Turn
    new_messages: list[Message]
    divergence: Divergence | None = None  # rollback / fork: recorded once the turn is stored


class Session:
    def __init__(self, session_id: str, mode: SessionMode, matcher: Matcher,
                 divergence: DivergencePolicy = "reject") -> None:
        self.id = session_id
        self.mode = mode
        self.matcher = matcher
        self.policy = divergence
        self.root = Turn(id=0, parent=None, messages=[])
        self.tail: Turn = self.root  # linear: the one live path ends here
        self.tools: list[dict] | None = None
        self.divergences: list[Divergence] = []  # rollbacks and forks (stored), rejections
        self._ids = itertools.count(1)
        self._probe: ReasoningProbe | None = None  # set for the duration of one attach

    def _match(self, stored: Message, replayed: Message, i: int, messages: list[Message]) -> bool:
        if self.matcher(stored, replayed):
            return True
        # The report's strict comparison: a field the template does not read cannot diverge.
        if self._probe is None or not omitted_reasoning(stored, replayed):
            return False
        reasoning = stored["reasoning_content"]
        return (self.matcher(stored, {**replayed, "reasoning_content": reasoning})
                and not self._probe(messages, i, reasoning))

    def _extends(self, node: Turn, messages: list[Message], start: int) -> bool:
        own = node.messages
        if len(own) >= len(messages):  # a request must add at least one message past a turn
            return False
        return all(self._match(own[i], messages[i], i, messages) for i in range(start, len(own)))

    def _first_difference(self, stored: list[Message], messages: list[Message]) -> int:
        for i, (a, b) in enumerate(zip(stored, messages)):
            if not self._match(a, b, i, messages):
                return i
        return min(len(stored), len(messages))

    def deepest_match(self, messages: list[Message]) -> Turn:
        node = self.root
        while True:
            nxt = next((c for c in reversed(node.children)
                        if self._extends(c, messages, len(node.messages))), None)
            if nxt is None:
                return node
            node = nxt

    def attach(self, messages: list[Message], tools: list[dict] | None,
               reads_reasoning: ReasoningProbe | None = None) -> Attach:
        """Where `messages` extend the session; SessionConflict when they may not."""
        self._probe = reads_reasoning
        try:
            return self._attach(messages, tools)
        finally:
            self._probe = None

    def _attach(self, messages: list[Message], tools: list[dict] | None) -> Attach:
        if self.tools is not None and self.root.children and tools != self.tools:
            raise SessionConflict("tools differ from the ones this session started with; a "
                                  "session renders one tool list (start a new session)")
        if self.mode == "linear":
            node, diverged = self._attach_linear(messages)
        else:
            node = self.deepest_match(messages)
            diverged = self._fork(node, messages)
        if node.truncated:
            raise SessionConflict(
                f"turn {node.id} stopped at the length limit ({node.finish_reason}); a truncated "
                f"turn cannot be extended (start a new session, or raise max_tokens)")
        new = messages[len(node.messages):]
        # Extending the tail adds only what the model did not write; assistant messages in the
        # first request are a demonstration (prompt context, mask 0); retries and divergences
        # were checked by _attach_linear.
        if (self.mode == "linear" and node is self.tail and node is not self.root
                and any(m.get("role") == "assistant" for m in new)):
            raise SessionConflict(
                f"the request adds an assistant message the model did not generate after turn "
                f"{node.id}; a linear session extends only with user/tool/system messages "
                f"(use session_mode='branching' for harnesses that rewrite history)")
        return Attach(node, new, diverged)

    def _is_retry(self, node: Turn, messages: list[Message]) -> bool:
        """A request attached at the tail's parent retries the tail's turn when it adds no
        assistant message past the tail's own prompt (whose demonstrations it may repeat)."""
        prompt = self.tail.messages[:-1]
        for k in range(len(node.messages), len(messages)):
            if messages[k].get("role") != "assistant":
                continue
            if k < len(prompt) and self._match(prompt[k], messages[k], k, messages):
                continue
            return False
        return True

    def _attach_linear(self, messages: list[Message]) -> tuple[Turn, Divergence | None]:
        tail = self.tail
        if tail is self.root:
            return tail, None
        path = tail.path()
        node = self.root  # the deepest turn of the tail's path that the request replays
        for t in path:
            if not self._extends(t, messages, len(node.messages)):
                break
            node = t
        if node is tail or (node is tail.parent and self._is_retry(node, messages)):
            return node, None
        at = self._first_difference(tail.messages, messages)
        role, what, sugg = describe_difference(tail.messages, messages, at, self.matcher)
        dropped = path[path.index(node) + 1:] if node is not self.root else path
        d = Divergence("rollback" if self.policy == "rollback" else "rejected", at, role, what,
                       node.id, [t.id for t in dropped], _replayed_tokens(dropped, messages),
                       sugg)
        if self.policy == "rollback":
            return node, d
        self.divergences.append(d)
        raise SessionConflict(
            f"linear session {self.id}: the request's history diverges from the stored history "
            f"{d.describe()}. A linear session may only extend its last turn (stored messages "
            f"0-{len(tail.messages) - 1}) or retry it: use a session_matcher that accepts this "
            f"replay, session_divergence='rollback' to keep the longest stored prefix it "
            f"replays, or session_mode='branching'", d)

    def _fork(self, node: Turn, messages: list[Message]) -> Divergence | None:
        """Branching: the request leaves a stored lineage at one of its assistant messages (a
        redundant branch when the harness only rewrote that message)."""
        start = len(node.messages)
        for child in reversed(node.children):
            at = self._first_difference(child.messages, messages)
            if (start <= at < min(len(child.messages), len(messages))
                    and child.messages[at].get("role") == "assistant"
                    and messages[at].get("role") == "assistant"):
                role, what, sugg = describe_difference(child.messages, messages, at, self.matcher)
                line = [child]
                while line[-1].children:
                    line.append(line[-1].children[-1])
                return Divergence("fork", at, role, what, node.id, [],
                                  _replayed_tokens(line, messages), sugg)
        return None

    def add_turn(self, at: Turn, messages: list[Message], tools: list[dict] | None,
                 divergence: Divergence | None = None, **fields: Any) -> Turn:
        """Store a completed turn under `at` (the only write; called after generation)."""
        turn = Turn(id=next(self._ids), parent=at, messages=messages, **fields)
        if divergence is not None:
            divergence.turn = turn.id
            self.divergences.append(divergence)
        turn.ids = at.ids + turn.prompt_ids + turn.output_ids
        at.children.append(turn)
        if self.tools is None:
            self.tools = tools
        if self.mode == "linear":
            self.tail = turn
        return turn

    def leaves(self) -> list[Turn]:
        """Linear: the tail. Branching: every leaf, oldest first."""
        if self.mode == "linear":
            return [] if self.tail is self.root else [self.tail]
        out: list[Turn] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(reversed(node.children))
        return sorted(out, key=lambda t: t.id)

    def summary(self) -> dict[str, Any]:
        def turn(t: Turn) -> dict[str, Any]:
            return {"id": t.id, "parent": t.parent.id if t.parent else None,
                    "messages": len(t.messages), "prompt_tokens": len(t.prompt_ids),
                    "output_tokens": len(t.output_ids), "finish_reason": t.finish_reason,
                    "weight_version": t.weight_version, "cached_tokens": t.cached_tokens}

        turns, stack = [], list(self.root.children)
        while stack:
            t = stack.pop()
            turns.append(turn(t))
            stack.extend(t.children)
        return {"session_id": self.id, "mode": self.mode, "turns": sorted(turns, key=lambda d: d["id"]),
                "leaves": [t.id for t in self.leaves()],
                "divergences": [d.to_dict() for d in self.divergences],
                "messages": self.leaves()[-1].messages if self.leaves() else []}


def _replayed_tokens(turns: list[Turn], messages: list[Message]) -> int:
    """Sampled tokens of `turns` whose reply the request re-sends (as text, to be re-tokenized)."""
    return sum(len(t.output_ids) for t in turns if len(t.messages) <= len(messages))
