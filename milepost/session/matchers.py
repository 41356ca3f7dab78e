"""Message matchers (report 2.4.2): does a replayed message count as the one stored at that
position? When it does, the stored message and its tokens stay authoritative.

- `strict` (default): role, content, reasoning_content and tool calls (id, name, arguments
  text); fields no template reads (name, refusal, annotations, ...) are ignored. A replay that
  omits the stored reasoning_content does NOT match (absent and "" are the same).
- `json_args`: as strict, but tool-call arguments match when they hold the same JSON (a harness
  that reserializes them, or sends `{}` for absent arguments); ids, names and order must agree.
- `loose`: role and visible text only (omitted reasoning matches). RISKY: two assistant turns with different tool calls
  and the same (often empty) text count as equal; the stored calls then win silently.
- a user matcher: `module.sub:function(stored: dict, replayed: dict) -> bool`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from milepost.plugins import load_callable

Message = dict[str, Any]
Matcher = Callable[[Message, Message], bool]

BUILTIN_MATCHERS = ("strict", "json_args", "loose")


def _text(m: Message) -> str:
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _reasoning_matches(stored: Message, replayed: Message) -> bool:
    return (replayed.get("reasoning_content") or "") == (stored.get("reasoning_content") or "")


def _calls(m: Message) -> list[dict[str, Any]]:
    out = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        out.append({"id": c.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments")})
    return out


def _same_json(a: Any, b: Any) -> bool:
    def load(x: Any) -> Any:
        if x is None or x == "":
            return {}  # absent arguments and "{}" mean the same call
        if isinstance(x, str):
            try:
                return json.loads(x)
            except json.JSONDecodeError:
                return ("unparsable", x)
        return x

    return load(a) == load(b)


def strict(stored: Message, replayed: Message) -> bool:
    return (stored.get("role") == replayed.get("role") and _text(stored) == _text(replayed)
            and _reasoning_matches(stored, replayed) and _calls(stored) == _calls(replayed)
            and stored.get("tool_call_id") == replayed.get("tool_call_id"))


def json_args(stored: Message, replayed: Message) -> bool:
    a, b = _calls(stored), _calls(replayed)
    if len(a) != len(b) or any(x["id"] != y["id"] or x["name"] != y["name"]
                               or not _same_json(x["arguments"], y["arguments"])
                               for x, y in zip(a, b)):
        return False
    return (stored.get("role") == replayed.get("role") and _text(stored) == _text(replayed)
            and _reasoning_matches(stored, replayed)
            and stored.get("tool_call_id") == replayed.get("tool_call_id"))


def loose(stored: Message, replayed: Message) -> bool:
    return stored.get("role") == replayed.get("role") and _text(stored) == _text(replayed)


def load_matcher(name: str) -> Matcher:
    """A built-in matcher by name, or a user matcher by import path."""
    builtins: dict[str, Matcher] = {"strict": strict, "json_args": json_args, "loose": loose}
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise ValueError(f"session_matcher: {name!r} is neither a built-in matcher "
                         f"{list(BUILTIN_MATCHERS)} nor an import path 'module.sub:function'")
    return load_callable(name, "session_matcher")
