"""Model families (report 2.4.3): one chat template handling + one reasoning parser + one tool-call
parser, registered under a name the user gives at launch (a family is never detected from the
checkpoint). The template itself is the checkpoint's own (its tokenizer's `chat_template`); the
family says how to read the model's output back into a message and where an assistant turn ends.

Registered: `qwen3` (`<think>` reasoning the template drops from earlier turns,
`<tool_call>{json}</tool_call>`), `qwen2.5`, `llama3` (3.1 / 3.2), `deepseek-v3` and `mistral`
(each with its own TITO-safe template: family_templates.py), `kimi-k2`, `chatml` (SmolLM2 and other
plain ChatML checkpoints), and `generic` (no parsers; warns that incremental tokenization may
diverge). docs/sessions.md has the table of what each one knows.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from milepost.session.family_templates import (
    DEEPSEEK_V3_TITO,
    GPT_OSS_TITO,
    MISTRAL_TITO,
)

log = logging.getLogger(__name__)

Message = dict[str, Any]


class FamilyError(ValueError):
    """The family name, or its template on this checkpoint, cannot serve a session."""


@dataclass(frozen=True)
class ParsedOutput:
    """An assistant completion read back into OpenAI message fields."""

    content: str
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    unparsed_tool_calls: int = 0  # tool-call blocks left in the content as text (bad JSON)

    def message(self) -> Message:
        msg: Message = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def parse_think(text: str, start: str = "<think>", end: str = "</think>",
                ) -> tuple[str | None, str]:
    """(reasoning, rest) when `text` opens with a think block; (None, text) otherwise. An
    unclosed block (cut by the length limit) is all reasoning."""
    stripped = text.lstrip()
    if not stripped.startswith(start):
        return None, text
    body = stripped[len(start):]
    if end not in body:
        return body.strip("\n"), ""
    reasoning, rest = body.split(end, 1)
    return reasoning.strip("\n"), rest.lstrip("\n")


_TOOL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_call_blocks(text: str) -> tuple[str, list[dict[str, Any]], int]:
    """(content before the first call, OpenAI tool_calls, blocks left unparsed) from
    `<tool_call>{json}</tool_call>` blocks; a block may hold one object or a list of them (SmolLM2
    writes lists). A block that is not valid JSON stays in the content: the model's text is never
    dropped, and the count reaches the metrics (`rollout/session_unparsed_tool_calls`)."""
    calls: list[dict[str, Any]] = []
    first = None
    bad = 0
    for m in _TOOL_BLOCK.finditer(text):
        try:
            payload = json.loads(m.group(1))
        except json.JSONDecodeError:
            bad += 1
            continue
        objs = payload if isinstance(payload, list) else [payload]
        if not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs):
            bad += 1
            continue
        first = m.start() if first is None else first
        for o in objs:
            args = o.get("arguments", {})
            calls.append({
                "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                "function": {"name": o["name"],
                             # OpenAI carries arguments as a JSON string.
                             "arguments": args if isinstance(args, str)
                             else json.dumps(args, ensure_ascii=False)}})
    if not calls:
        return text, [], bad
    return text[:first].rstrip("\n"), calls, bad


@dataclass(frozen=True)
class Family:
    """name: what the user writes (`--session-model-family`). end_of_turn: the text of the token
    that closes an assistant turn in the template. parse: output text (special tokens kept,
    end_of_turn removed) -> message fields. checked: a maintainer ran both checks (the CPU
    append-only battery and the live engine check) on a checkpoint of this family."""

    name: str
    end_of_turn: str
    parse: Callable[[str], ParsedOutput]
    checked: bool = True
    description: str = ""
    # What a token-by-token stream must know of `parse` (session/streaming.py): the reasoning
    # block's (open, close) markers, and the text that opens a tool call. The stream holds back
    # text from the tool-call marker on, so streamed deltas always add up to the parsed reply.
    think_markers: tuple[str, str] | None = None
    tool_call_open: str | None = None
    # The template drops earlier turns' reasoning (Qwen3: before the last user message) and writes
    # an empty think block only on the last turn: the server keeps what the model saw and takes
    # each suffix from the template's text after the stored turns (render.py).
    rewrites_reasoning: bool = False
    # The template renders tool-call arguments with `tojson` and so expects objects, where OpenAI
    # messages carry JSON strings (Qwen2.5, Llama 3.1): the renderer hands it objects.
    tool_args_as_objects: bool = False
    # False: the template refuses more than one tool call per assistant turn (Llama 3.x).
    parallel_tool_calls: bool = True
    # A TITO-safe template the family renders with instead of the checkpoint's, when the published
    # one cannot extend a session (family_templates.py says what it fixes); logged at start.
    chat_template: str | None = None
    # Turns that end on the NEXT message's header (GLM: the model stops on <|user|> or
    # <|observation|>, which the template writes only when a message follows): (role of the next
    # message, its header) pairs, role "" for any other. Each header is an end-of-turn token.
    turn_end_by_next: tuple[tuple[str, str], ...] = ()
    # Other tokens that end an assistant turn, written by the template too (gpt-oss: <|call|>
    # after a tool call, end_of_turn <|return|> after a final answer).
    more_turn_ends: tuple[str, ...] = ()

    @property
    def turn_ends(self) -> tuple[str, ...]:
        """Every token text that ends an assistant turn (end_of_turn first)."""
        more = [m for _, m in self.turn_end_by_next if m != self.end_of_turn]
        more += [m for m in self.more_turn_ends if m != self.end_of_turn]
        return (self.end_of_turn, *dict.fromkeys(more)) if self.end_of_turn else tuple(more)

    def turn_end_before(self, next_role: str | None) -> str:
        """The header the template writes after an assistant turn followed by `next_role`
        (None: the conversation goes on with a user message)."""
        pairs = dict(self.turn_end_by_next)
        return pairs.get(next_role or "user", pairs.get("", self.end_of_turn))


def _parse_qwen3(text: str) -> ParsedOutput:
    reasoning, rest = parse_think(text)
    content, calls, bad = parse_tool_call_blocks(rest)
    return ParsedOutput(content=content, reasoning_content=reasoning, tool_calls=calls,
                        unparsed_tool_calls=bad)


def _parse_chatml(text: str) -> ParsedOutput:
    content, calls, bad = parse_tool_call_blocks(text)
    return ParsedOutput(content=content, tool_calls=calls, unparsed_tool_calls=bad)


def _parse_llama3(text: str) -> ParsedOutput:
    """Llama 3.x writes a tool call as the whole reply: {"name": ..., "parameters": {...}}
    (after <|python_tag|> for built-in tools); anything else is content."""
    body = text.removeprefix("<|python_tag|>").strip()
    if not body.startswith('{"name"'):
        return ParsedOutput(content=text)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return ParsedOutput(content=text, unparsed_tool_calls=1)
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return ParsedOutput(content=text, unparsed_tool_calls=1)
    args = obj.get("parameters", obj.get("arguments", {}))
    return ParsedOutput(content="", tool_calls=[{
        "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
        "function": {"name": obj["name"], "arguments": args if isinstance(args, str)
                     else json.dumps(args, ensure_ascii=False)}}])


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>(.*?)\n```json\n(.*?)\n```"
                      r"<｜tool▁call▁end｜>", re.DOTALL)


def _parse_deepseek_v3(text: str) -> ParsedOutput:
    """Content, then <｜tool▁calls▁begin｜> with one <｜tool▁call▁begin｜>type<｜tool▁sep｜>name
    ```json args``` <｜tool▁call▁end｜> per call; a section whose calls do not parse stays text."""
    at = text.find("<｜tool▁calls▁begin｜>")
    if at < 0:
        return ParsedOutput(content=text)
    calls, bad = [], 0
    for m in _DS_CALL.finditer(text, at):
        try:
            json.loads(m.group(3))
        except json.JSONDecodeError:
            bad += 1
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": m.group(1),
                      "function": {"name": m.group(2), "arguments": m.group(3)}})
    if not calls:
        return ParsedOutput(content=text, unparsed_tool_calls=max(bad, 1))
    return ParsedOutput(content=text[:at], tool_calls=calls, unparsed_tool_calls=bad)


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]*?)\s*<\|tool_call_argument_begin\|>\s*"
                        r"(.*?)\s*<\|tool_call_end\|>", re.DOTALL)
_KIMI_ID = re.compile(r"(?:functions\.)?([\w\-.]+):\d+")


def _parse_kimi_k2(text: str) -> ParsedOutput:
    """Content, then <|tool_calls_section_begin|> with one <|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{json}<|tool_call_end|> per call. The id the model wrote is the
    call's id (the template renders it back, and names the result after it)."""
    at = text.find("<|tool_calls_section_begin|>")
    if at < 0:
        return ParsedOutput(content=text)
    calls, bad = [], 0
    for m in _KIMI_CALL.finditer(text, at):
        name = _KIMI_ID.fullmatch(m.group(1))
        try:
            json.loads(m.group(2))
        except json.JSONDecodeError:
            name = None
        if name is None:
            bad += 1
            continue
        calls.append({"id": m.group(1), "type": "function",
                      "function": {"name": name.group(1), "arguments": m.group(2)}})
    if not calls:
        return ParsedOutput(content=text, unparsed_tool_calls=max(bad, 1))
    return ParsedOutput(content=text[:at], tool_calls=calls, unparsed_tool_calls=bad)


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _mistral_id() -> str:
    return uuid.uuid4().hex[:9]  # the template's ids: 9 alphanumeric characters


def _parse_mistral(text: str) -> ParsedOutput:
    """[TOOL_CALLS] followed by a JSON list of {"name", "arguments", "id"} (v3); the model's id is
    kept when it is 9 alphanumeric characters, else one of that form is made."""
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return ParsedOutput(content=text)
    try:
        payload = json.loads(text[at + len("[TOOL_CALLS]"):].strip())
    except json.JSONDecodeError:
        return ParsedOutput(content=text, unparsed_tool_calls=1)
    objs = payload if isinstance(payload, list) else [payload]
    if not objs or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs):
        return ParsedOutput(content=text, unparsed_tool_calls=1)
    calls = []
    for o in objs:
        args = o.get("arguments", {})
        cid = o.get("id")
        calls.append({"id": cid if isinstance(cid, str) and _MISTRAL_ID.fullmatch(cid)
                      else _mistral_id(), "type": "function",
                      "function": {"name": o["name"], "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
    return ParsedOutput(content=text[:at], tool_calls=calls)


_GLM_CALL = re.compile(r"<tool_call>([^\n<]*)(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm_value(v: str) -> Any:
    """The template writes strings raw and anything else as JSON: JSON first, else the string."""
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def _parse_glm4(text: str) -> ParsedOutput:
    """`\n<think>...</think>\ncontent`, then <tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V
    </arg_value>...</tool_call> blocks. A value that reads as JSON is taken as JSON (the template's
    own rendering of non-strings), so a string argument "5" comes back as the number 5."""
    reasoning, rest = parse_think(text)
    calls, bad, first = [], 0, None
    for m in _GLM_CALL.finditer(rest):
        name, body = m.group(1).strip(), m.group(2)
        pairs = _GLM_ARG.findall(body)
        if not name or _GLM_ARG.sub("", body).strip():
            bad += 1
            continue
        first = m.start() if first is None else first
        calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps(
                          {k: _glm_value(v) for k, v in pairs}, ensure_ascii=False)}})
    content = rest if first is None else rest[:first]
    return ParsedOutput(content=content.rstrip("\n"), reasoning_content=reasoning,
                        tool_calls=calls, unparsed_tool_calls=bad)


_HARMONY_HEADER = re.compile(r"<\|channel\|>\s*(\w+)")
_HARMONY_TO = re.compile(r"to=([^\s<]+)")


def _parse_harmony(text: str) -> ParsedOutput:
    """gpt-oss's messages after `<|start|>assistant`: analysis -> reasoning, final (and a
    commentary preamble) -> content, commentary to=functions.NAME -> a tool call (its JSON body
    the arguments; the recipient may stand before or after the channel). Text without a channel
    header is content as written."""
    if "<|channel|>" not in text:
        return ParsedOutput(content=text)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    bad = 0
    for message in text.split("<|start|>"):
        header, sep, body = message.partition("<|message|>")
        body = re.split(r"<\|end\|>|<\|call\|>|<\|return\|>", body, maxsplit=1)[0]
        channel = _HARMONY_HEADER.search(header)
        to = _HARMONY_TO.search(header)
        if not sep or channel is None:
            if message.strip() and message.strip() != "assistant":
                content.append(message)  # not a harmony message: kept as written
            continue
        if to is not None and to.group(1).startswith("functions."):
            try:
                json.loads(body)
            except json.JSONDecodeError:
                bad += 1
                content.append(message)
                continue
            calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                          "function": {"name": to.group(1).removeprefix("functions."),
                                       "arguments": body}})
        elif channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    return ParsedOutput(content="".join(content),
                        reasoning_content="\n".join(reasoning) if reasoning else None,
                        tool_calls=calls, unparsed_tool_calls=bad)


def _parse_plain(text: str) -> ParsedOutput:
    return ParsedOutput(content=text)


_REGISTRY: dict[str, Family] = {}


def register_family(family: Family) -> None:
    if family.name in _REGISTRY:
        raise FamilyError(f"model family {family.name!r} is registered already")
    _REGISTRY[family.name] = family


def family_names() -> list[str]:
    return sorted(_REGISTRY)


def get_family(name: str) -> Family:
    """The registered family `name`; `generic` warns once per call that it is unchecked."""
    if name not in _REGISTRY:
        raise FamilyError(f"session_model_family: unknown family {name!r}; registered: "
                          f"{family_names()} (name the family of your checkpoint explicitly; "
                          f"'generic' works for others but may diverge)")
    family = _REGISTRY[name]
    if not family.checked:
        log.warning("model family %r: no parser or template check is registered for this "
                    "checkpoint; incremental tokenization may diverge from the template's "
                    "canonical output", name)
    return family


register_family(Family("qwen3", "<|im_end|>", _parse_qwen3,
                       description="Qwen3 (thinking, hybrid and instruct-2507 checkpoints): "
                       "<think> reasoning, dropped from earlier turns by the template; "
                       "<tool_call> JSON",
                       think_markers=("<think>", "</think>"), tool_call_open="<tool_call>",
                       rewrites_reasoning=True))
register_family(Family("qwen2.5", "<|im_end|>", _parse_chatml,
                       description="Qwen2.5 Instruct: ChatML, <tool_call> JSON, arguments "
                       "rendered as objects", tool_call_open="<tool_call>",
                       tool_args_as_objects=True))
register_family(Family("llama3", "<|eot_id|>", _parse_llama3,
                       description="Llama 3.1 / 3.2 Instruct: header-id turns; a tool call is "
                       "the whole reply as JSON {name, parameters}; tool results as ipython; "
                       "one call per turn", tool_call_open='{"name"', tool_args_as_objects=True,
                       parallel_tool_calls=False))
register_family(Family("deepseek-v3", "<｜end▁of▁sentence｜>", _parse_deepseek_v3,
                       description="DeepSeek-V3 (0324): <｜tool▁calls▁begin｜> sections; renders "
                       "with its own TITO-safe template (the published one cannot close a lone "
                       "tool call)", tool_call_open="<｜tool▁calls▁begin｜>",
                       chat_template=DEEPSEEK_V3_TITO))
register_family(Family("kimi-k2", "<|im_end|>", _parse_kimi_k2,
                       description="Kimi K2 Instruct: <|im_user|>/<|im_assistant|> headers, "
                       "<|tool_calls_section_begin|> sections with functions.NAME:IDX ids",
                       tool_call_open="<|tool_calls_section_begin|>"))
register_family(Family("mistral", "</s>", _parse_mistral,
                       description="Mistral Instruct v3 / tekken: [INST] turns, [TOOL_CALLS] JSON "
                       "lists with 9-character ids; renders with its own TITO-safe template (the "
                       "published one moves the system prompt and tools to the last user turn)",
                       tool_call_open="[TOOL_CALLS]", tool_args_as_objects=True,
                       chat_template=MISTRAL_TITO))
register_family(Family("glm4", "<|user|>", _parse_glm4,
                       description="GLM-4.5 / 4.6: turns end on the next message's header "
                       "(<|user|> or <|observation|>); <think> reasoning shown only after the last "
                       "user message; <tool_call>NAME with <arg_key>/<arg_value> pairs",
                       think_markers=("<think>", "</think>"), tool_call_open="<tool_call>",
                       rewrites_reasoning=True, tool_args_as_objects=True,
                       turn_end_by_next=(("tool", "<|observation|>"), ("", "<|user|>"))))
register_family(Family("gpt-oss", "<|return|>", _parse_harmony,
                       description="gpt-oss (harmony): analysis / final / commentary channels, one "
                       "tool call per turn ending on <|call|>; renders with its own TITO-safe "
                       "template (the published one rewrites <|return|> to <|end|> and drops "
                       "analysis in history)",
                       think_markers=("<|channel|>analysis<|message|>", "<|end|>"),
                       # every later harmony header holds the content back until the turn ends
                       tool_call_open="<|", tool_args_as_objects=True, parallel_tool_calls=False,
                       more_turn_ends=("<|call|>",), chat_template=GPT_OSS_TITO))
register_family(Family("chatml", "<|im_end|>", _parse_chatml,
                       description="ChatML (SmolLM2): <tool_call> JSON in the text",
                       tool_call_open="<tool_call>"))
register_family(Family("generic", "", _parse_plain, checked=False,
                       description="any template; no parsers; turn end from the tokenizer's EOS"))
