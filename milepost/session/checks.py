"""The CPU check of a family registration (report 2.4.3): over a battery of conversations (tools,
reasoning, several tool results, many turns), the ids the session server builds turn by turn
(stored ids + tokenized suffix) must equal the tokenization of their whole text, and that text must
be the template's canonical rendering (for a family whose template drops reasoning: once reasoning
blocks are removed). The session server runs it at start and refuses a template that fails it.
The live check (real stop tokens and parsing against an engine) is check_family.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from milepost.session.families import Message
from milepost.session.render import Renderer, RenderError

_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def _call(i: int, city: str) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}


BATTERY: list[tuple[str, list[Message], list[dict] | None]] = [
    ("multi-turn chat", [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"},
    ], None),
    ("no system prompt", [
        {"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
        {"role": "user", "content": "Three"}, {"role": "assistant", "content": "Four"},
    ], None),
    ("reasoning every turn", [
        {"role": "user", "content": "Think: 5*5?"},
        {"role": "assistant", "content": "25", "reasoning_content": "5 times 5 is 25."},
        {"role": "user", "content": "Now 6*6?"},
        {"role": "assistant", "content": "36", "reasoning_content": "6 times 6 is 36."},
        {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome."},
    ], None),
    ("tools, one call per turn", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call(1, "Paris")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny in Paris."},
        {"role": "user", "content": "And Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call again.",
         "tool_calls": [_call(2, "Oslo")]},
        {"role": "tool", "tool_call_id": "call_2", "content": "snow"},
        {"role": "assistant", "content": "Snow in Oslo."},
    ], _TOOLS),
    ("tools, parallel calls and results", [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Rome and Lima?"},
        {"role": "assistant", "content": "Checking both.",
         "tool_calls": [_call(3, "Rome"), _call(4, "Lima")]},
        {"role": "tool", "tool_call_id": "call_3", "content": "hot"},
        {"role": "tool", "tool_call_id": "call_4", "content": "mild"},
        {"role": "assistant", "content": "Rome is hot, Lima mild."},
    ], _TOOLS),
]


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str = ""


def incremental_text(r: Renderer, messages: list[Message], tools: list[dict] | None
                     ) -> list[str]:
    """The text pieces the session server tokenizes one by one for `messages` (first prompt,
    then each assistant turn as if the model had written its canonical text, end-of-turn token
    included, then each suffix)."""
    pieces: list[str] = []
    stored = None
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        history = messages[:k]
        if stored is None:
            prompt_text = r.prompt_text(history, tools)
            pieces.append(prompt_text)
        else:
            prompt_text, suffix = r.prompt_and_suffix(stored, True, history, tools)
            pieces.append(suffix)
        after = messages[k + 1]["role"] if k + 1 < len(messages) else None
        turn_text = r.cut_after_last_turn(r.render(messages[:k + 1], tools, False), after)
        if not turn_text.startswith(prompt_text):
            raise RenderError(f"message {k}: the assistant turn does not render right after the "
                              f"generation prompt")
        pieces.append(turn_text[len(prompt_text):])
        stored = r.stored_after(prompt_text)
    return pieces


def incremental_ids(r: Renderer, messages: list[Message], tools: list[dict] | None) -> list[int]:
    """The ids the session server builds for `messages` (each piece tokenized on its own)."""
    return [t for piece in incremental_text(r, messages, tools) for t in r.encode(piece)]


def check_append_only(r: Renderer, battery: list[tuple[str, list[Message], list[dict] | None]]
                      = BATTERY) -> list[CheckResult]:
    """Per conversation: the incremental ids equal the tokenization of their whole text (no
    token merges across pieces), and that text is the template's canonical rendering of the
    conversation (for a family that rewrites reasoning: equal once reasoning blocks are removed,
    i.e. the template changes nothing else turn to turn)."""
    results = []
    for name, messages, tools in battery:
        if not r.family.parallel_tool_calls and any(
                len(m.get("tool_calls") or []) > 1 for m in messages):
            results.append(CheckResult(name, True, "skipped: the family's template allows one "
                                                   "tool call per turn"))
            continue
        messages = copy.deepcopy(messages)
        try:
            canonical = r.cut_after_last_turn(r.render(messages, tools, False))
            pieces = incremental_text(r, messages, tools)
        except RenderError as e:
            results.append(CheckResult(name, False, str(e)))
            continue
        text = "".join(pieces)
        got = [t for piece in pieces for t in r.encode(piece)]
        want = r.encode(text)
        if r.family.rewrites_reasoning:
            same, a, b = (r.without_reasoning(text) == r.without_reasoning(canonical),
                          r.without_reasoning(text), r.without_reasoning(canonical))
        else:
            same, a, b = text == canonical, text, canonical
        if not same:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            ta, tb = r.encode(a), r.encode(b)
            k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            results.append(CheckResult(name, False, f"the turn-by-turn text differs from the "
                                                    f"template's rendering at character {at}, "
                                                    f"token {k}: turn by turn "
                                                    f"{token_context(r, ta, k)}, template "
                                                    f"{token_context(r, tb, k)}"))
        elif got != want:
            at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                      min(len(got), len(want)))
            results.append(CheckResult(name, False, f"incremental ids differ from the whole "
                                                    f"text's tokenization at id {at}: turn by "
                                                    f"turn {token_context(r, got, at)}, whole "
                                                    f"{token_context(r, want, at)}"))
        else:
            results.append(CheckResult(name, True))
    return results


def token_context(r: Renderer, ids: list[int], at: int, width: int = 4) -> str:
    """Tokens around position `at`, each decoded, the one at `at` in brackets."""
    parts = [f"[{r.decode([t])!r}]" if i == at else repr(r.decode([t]))
             for i, t in enumerate(ids[max(0, at - width):at + width], start=max(0, at - width))]
    return " ".join(parts) + (" [end]" if at >= len(ids) else "")


def require_append_only(r: Renderer) -> None:
    """Refuse (RenderError) a family + template that fails the battery."""
    failed = [c for c in check_append_only(r) if not c.ok]
    if failed:
        lines = "; ".join(f"{c.name}: {c.detail}" for c in failed)
        raise RenderError(f"model family {r.family.name!r} with this checkpoint's chat template "
                          f"is not append-only turn to turn ({lines}); the session server cannot "
                          f"extend its sessions token-exactly (fix the template or the family)")
