"""What happens when a request does not replay a session's stored history (report 2.4.1, 2.4.2),
`--session-divergence rollback|reject`:

- reject (default): a linear session answers 409 naming the message index and the field that
  differed, and the matcher that would accept the replay when a safe one would;
- rollback: a linear session keeps the longest stored prefix the request does replay, attaches
  there and records what it dropped; the sampled tokens of the dropped turns whose text the request
  replays become re-tokenized prompt context (loss mask 0): `retokenized_tokens`.
A branching session forks instead (kind `fork`), recorded the same way. Every record is kept on the
session (`GET /sessions/{id}`), logged as a warning, returned with the turn (header and
`milepost.divergence`), and counted in the samples' metadata (`rollout/session_*` metrics).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from milepost.session.matchers import Matcher, difference, suggest_matcher

log = logging.getLogger(__name__)

DivergencePolicy = Literal["rollback", "reject"]
DIVERGENCE_POLICIES = ("rollback", "reject")
HEADER = "X-Milepost-Session-Divergence"

Message = dict[str, Any]


@dataclass
class Divergence:
    kind: Literal["rollback", "fork", "rejected"]
    message: int  # index of the first request message that differs from the stored history
    role: str  # the stored message's role at that index ("" when the request is longer)
    field: str  # which field differed, in words
    kept_turn: int  # the checkpoint the request attached to (0: the root)
    dropped_turns: list[int] = field(default_factory=list)  # rollback: turns off the tail's path
    retokenized_tokens: int = 0  # sampled tokens whose text the request re-sends as context
    suggestion: str | None = None  # a built-in matcher that would accept the replay
    turn: int | None = None  # the turn stored after it (None while pending, or rejected)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def header(self) -> str:
        return f"{self.kind}; message={self.message}; field={self.field.split(' ')[0]}"

    def describe(self) -> str:
        what = {"rollback": "rolled back to turn", "fork": "forked a new branch at turn",
                "rejected": "refused; the request replays the stored turns up to turn"}[self.kind]
        hint = (f"; --session-matcher {self.suggestion} accepts this replay" if self.suggestion
                else "")
        lost = (f", {self.retokenized_tokens} sampled tokens re-tokenized as context"
                if self.retokenized_tokens and self.kind != "rejected" else "")
        return (f"at message {self.message} ({self.role or 'past the stored turns'}), in "
                f"{self.field}: {what} {self.kept_turn}{lost}{hint}")


def describe_difference(stored: list[Message], replayed: list[Message], at: int,
                        matcher: Matcher) -> tuple[str, str, str | None]:
    """(role, field, suggested matcher) of the first difference, at index `at`."""
    if at >= len(stored) or at >= len(replayed):
        return "", "length (the request stops before the stored turns end)", None
    a, b = stored[at], replayed[at]
    sugg = suggest_matcher(a, b)
    if sugg is not None and matcher(a, b):  # the session's matcher already accepts it
        sugg = None
    return str(a.get("role")), difference(a, b), sugg


def warn(session_id: str, d: Divergence) -> None:
    log.warning("session %s: %s", session_id, d.describe())


def counts(records: list[Divergence]) -> dict[str, int]:
    """Per-session numbers for a sample's metadata (summed per session into rollout metrics)."""
    return {"session_rollbacks": sum(d.kind == "rollback" for d in records),
            "session_forks": sum(d.kind == "fork" for d in records),
            "session_rejections": sum(d.kind == "rejected" for d in records),
            "session_retokenized_tokens": sum(d.retokenized_tokens for d in records
                                              if d.kind != "rejected")}
