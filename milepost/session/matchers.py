"""Message matchers (report 2.4.2): does a replayed message count as the one stored at that
position? When it does, the stored message and its tokens stay authoritative.

- `strict` (default): role, content, reasoning_content and tool calls (id, name, arguments
  text); fields no template reads (name, refusal, annotations, ...) are ignored. A replay that
  omits the stored reasoning_content does NOT match (absent and "" are the same).
- `json_args`: as strict, but tool-call arguments match when they hold the same JSON (a harness
  that reserializes them, or sends `{}` for absent arguments); ids, names and order must agree.
- `omit_reasoning`: as json_args, and a replay that omits reasoning_content (absent, None or "")
  matches the stored one, whatever the template reads; a different reasoning text still does not.
  For harnesses (the `openai` client's own loop, most agent frameworks) that never send
  reasoning back: the stored reasoning, which the engine did see, stays in the tokens.
- `loose`: role and visible text only (omitted reasoning matches). RISKY: two assistant turns with
  different tool calls and the same (often empty) text count as equal; the stored calls then win.
- a user matcher: `module.sub:function(stored: dict, replayed: dict) -> bool`.

Independently of the matcher, the session treats an omitted reasoning_content as the stored one
where the chat template does not read it (Qwen3 drops the reasoning of turns before the last user
message): the report's strict matcher compares only fields the template reads (store.py).
`difference` names the first field that differs, for 409 messages and divergence records.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from milepost.plugins import load_callable

Message = dict[str, Any]
Matcher = Callable[[Message, Message], bool]

BUILTIN_MATCHERS = ("strict", "json_args", "omit_reasoning", "loose")


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


def omitted_reasoning(stored: Message, replayed: Message) -> bool:
    """The replay leaves out a reasoning the stored message has."""
    return bool(stored.get("reasoning_content")) and not replayed.get("reasoning_content")


def omit_reasoning(stored: Message, replayed: Message) -> bool:
    if omitted_reasoning(stored, replayed):
        replayed = {**replayed, "reasoning_content": stored["reasoning_content"]}
    return json_args(stored, replayed)


def loose(stored: Message, replayed: Message) -> bool:
    return stored.get("role") == replayed.get("role") and _text(stored) == _text(replayed)


def load_matcher(name: str) -> Matcher:
    """A built-in matcher by name, or a user matcher by import path."""
    builtins: dict[str, Matcher] = {"strict": strict, "json_args": json_args,
                                    "omit_reasoning": omit_reasoning, "loose": loose}
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise ValueError(f"session_matcher: {name!r} is neither a built-in matcher "
                         f"{list(BUILTIN_MATCHERS)} nor an import path 'module.sub:function'")
    return load_callable(name, "session_matcher")


def difference(stored: Message, replayed: Message) -> str:
    """The first field a template reads in which `replayed` differs from `stored`, in words."""
    if stored.get("role") != replayed.get("role"):
        return f"role ({stored.get('role')!r} stored, {replayed.get('role')!r} sent)"
    if _text(stored) != _text(replayed):
        return "content"
    if not _reasoning_matches(stored, replayed):
        return ("reasoning_content (omitted by the request)" if omitted_reasoning(stored, replayed)
                else "reasoning_content")
    a, b = _calls(stored), _calls(replayed)
    if len(a) != len(b):
        return f"tool_calls ({len(a)} stored, {len(b)} sent)"
    for k, (x, y) in enumerate(zip(a, b)):
        for key in ("id", "name"):
            if x[key] != y[key]:
                return f"tool_calls[{k}].{'function.name' if key == 'name' else key}"
        if x["arguments"] != y["arguments"]:
            same = " (the same JSON, serialized differently)" if _same_json(
                x["arguments"], y["arguments"]) else ""
            return f"tool_calls[{k}].function.arguments{same}"
    if stored.get("tool_call_id") != replayed.get("tool_call_id"):
        return "tool_call_id"
    return "a field the session's matcher compares"


def suggest_matcher(stored: Message, replayed: Message) -> str | None:
    """The strictest built-in matcher that would accept `replayed` as `stored`, if a safe one does
    (loose is never suggested: it can merge different tool calls)."""
    for name, fn in (("json_args", json_args), ("omit_reasoning", omit_reasoning)):
        if fn(stored, replayed):
            return name
    return None
