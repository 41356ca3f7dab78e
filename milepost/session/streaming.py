"""OpenAI stream deltas of one assistant turn, token by token, as the engine produces it.

Each engine chunk carries every output id so far; the text they decode to is read the way the
family's parser will read the finished turn, and only what no continuation can change is sent:
reasoning between the family's think markers, content up to a tool-call marker (or a partial
marker, trailing newlines, an unfinished UTF-8 character). Tool calls are sent whole when the
turn ends, from the final parse, so their ids are the stored ones. The deltas of a turn always add
up to the stored reply (`finish` checks it).
"""

from __future__ import annotations

import logging
from typing import Any

from milepost.session.families import Family, Message

log = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"  # what a decoder shows for the first bytes of a multi-byte character
_FIELDS = ("reasoning_content", "content")


def _partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class DeltaStream:
    """`update(text)` with the decoded output so far -> the deltas it makes safe to send;
    `finish(reply)` with the parsed reply -> the rest (remaining text, then the tool calls)."""

    def __init__(self, family: Family) -> None:
        self.family = family
        self.sent = {f: "" for f in _FIELDS}
        self.consistent = True  # False if the final parse did not extend what was sent

    def stable_view(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that the parse of every continuation of `text` begins with."""
        text = text.rstrip(_INCOMPLETE)
        reasoning, rest = "", text
        if self.family.think_markers is not None:
            opener, closer = self.family.think_markers
            stripped = text.lstrip()
            if opener.startswith(stripped):  # nothing yet, or a think block may be opening
                return "", ""
            if stripped.startswith(opener):
                body = stripped[len(opener):]
                if closer not in body:
                    cut = len(body) - _partial_marker_len(body, closer)
                    return body[:cut].strip("\n"), ""
                reasoning, rest = body.split(closer, 1)
                reasoning, rest = reasoning.strip("\n"), rest.lstrip("\n")
        openers = self.family.tool_call_open
        for opener in (openers,) if isinstance(openers, str) else openers or ():
            at = rest.find(opener)
            rest = rest[:at] if at >= 0 else rest[:len(rest) - _partial_marker_len(rest, opener)]
        return reasoning, rest.rstrip("\n")

    def _advance(self, field: str, target: str) -> dict[str, Any] | None:
        sent = self.sent[field]
        if len(target) <= len(sent) or not target.startswith(sent):
            return None
        self.sent[field] = target
        return {field: target[len(sent):]}

    def update(self, text: str) -> list[dict[str, Any]]:
        view = self.stable_view(text)
        return [d for f, t in zip(_FIELDS, view) if (d := self._advance(f, t)) is not None]

    def finish(self, reply: Message) -> list[dict[str, Any]]:
        deltas = []
        for f in _FIELDS:
            target = reply.get(f) or ""
            if not target.startswith(self.sent[f]):
                self.consistent = False
                log.error("session stream: the streamed %s %r is not a prefix of the parsed "
                          "reply's %r (family %r); the client's view differs from the stored "
                          "turn", f, self.sent[f][-80:], target[:80], self.family.name)
                continue
            if (d := self._advance(f, target)) is not None:
                deltas.append(d)
        for i, call in enumerate(reply.get("tool_calls") or []):
            deltas.append({"tool_calls": [{"index": i, **call}]})
        return deltas
