"""A session's stored history (report 2.4.1): a tree of turn checkpoints.

Every completed turn is a checkpoint holding the ids it appended (prompt suffix, then the model's
output ids), the output's log-probs, weight versions and routed experts, and the message path up
to and including the model's reply. A request attaches at the deepest checkpoint whose message
path its messages extend (under the session's matcher).

- linear: the request must extend the tail, or retry the tail's turn (attach at its parent, which
  replaces the tail); anything else is refused. One training sequence.
- branching: the tree is append-only; any attach point opens a new branch. One sequence per leaf.
Either way a turn that stopped at the length limit cannot be extended. Nothing is written until
a turn has completed, so a refused or failed request leaves the stored history as it was.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

from milepost.session.matchers import Matcher
from milepost.session.render import Rendered

Message = dict[str, Any]
SessionMode = Literal["linear", "branching"]


class SessionConflict(ValueError):
    """The request cannot extend this session (HTTP 409); the message says why."""


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
    rendered: Rendered | None = None  # template text up to this turn's end-of-turn marker
    ended_with_eot: bool = True
    cached_tokens: int = 0
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


class Session:
    def __init__(self, session_id: str, mode: SessionMode, matcher: Matcher) -> None:
        self.id = session_id
        self.mode = mode
        self.matcher = matcher
        self.root = Turn(id=0, parent=None, messages=[])
        self.tail: Turn = self.root  # linear: the one live path ends here
        self.tools: list[dict] | None = None
        self._ids = itertools.count(1)

    def _extends(self, node: Turn, messages: list[Message], start: int) -> bool:
        own = node.messages
        if len(own) >= len(messages):  # a request must add at least one message past a turn
            return False
        return all(self.matcher(own[i], messages[i]) for i in range(start, len(own)))

    def deepest_match(self, messages: list[Message]) -> Turn:
        node = self.root
        while True:
            nxt = next((c for c in reversed(node.children)
                        if self._extends(c, messages, len(node.messages))), None)
            if nxt is None:
                return node
            node = nxt

    def attach(self, messages: list[Message], tools: list[dict] | None) -> Attach:
        """Where `messages` extend the session; SessionConflict when they may not."""
        if self.tools is not None and self.root.children and tools != self.tools:
            raise SessionConflict("tools differ from the ones this session started with; a "
                                  "session renders one tool list (start a new session)")
        if self.mode == "linear":
            node = self._attach_linear(messages)
        else:
            node = self.deepest_match(messages)
        if node.truncated:
            raise SessionConflict(
                f"turn {node.id} stopped at the length limit ({node.finish_reason}); a truncated "
                f"turn cannot be extended (start a new session, or raise max_tokens)")
        new = messages[len(node.messages):]
        if (any(m.get("role") == "assistant" for m in new) and self.mode == "linear"
                and not self._few_shot(node, new)):
            raise SessionConflict(
                f"the request adds an assistant message the model did not generate after turn "
                f"{node.id}; a linear session extends only with user/tool/system messages "
                f"(use session_mode='branching' for harnesses that rewrite history)")
        return Attach(node, new)

    def _few_shot(self, node: Turn, new: list[Message]) -> bool:
        """Assistant messages in the first prompt are prompt context (a demonstration, mask 0):
        allowed in the first request, and in a retry of the first turn that repeats its prompt."""
        if node is not self.root:
            return False
        if self.tail is self.root:
            return True
        first_prompt = self.tail.path()[0].messages[:-1]
        return len(new) >= len(first_prompt) and all(
            self.matcher(a, b) for a, b in zip(first_prompt, new))

    def _attach_linear(self, messages: list[Message]) -> Turn:
        tail = self.tail
        if tail is self.root or self._extends(tail, messages, 0):
            return tail
        parent = tail.parent
        if parent is not None and (parent is self.root or self._extends(parent, messages, 0)):
            return parent  # a retry of the last turn: it replaces the tail once generated
        at = _first_difference(tail.messages, messages, self.matcher)
        raise SessionConflict(
            f"linear session {self.id}: the request's history diverges from the stored history "
            f"at message {at} (stored turns end at message {len(tail.messages) - 1}); a linear "
            f"session may only extend its last turn or retry it (use session_mode='branching', "
            f"or a looser session_matcher if the harness rewrites messages)")

    def add_turn(self, at: Turn, messages: list[Message], tools: list[dict] | None,
                 **fields: Any) -> Turn:
        """Store a completed turn under `at` (the only write; called after generation)."""
        turn = Turn(id=next(self._ids), parent=at, messages=messages, **fields)
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
                "messages": self.leaves()[-1].messages if self.leaves() else []}


def _first_difference(stored: list[Message], replayed: list[Message], matcher: Matcher) -> int:
    for i, (a, b) in enumerate(zip(stored, replayed)):
        if not matcher(a, b):
            return i
    return min(len(stored), len(replayed))
