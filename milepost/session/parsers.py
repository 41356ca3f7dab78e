"""Parsers of model output into OpenAI message fields, one per tool-call / reasoning format
(families.py registers them with the template behaviour of each model family). A block that does
not parse stays in the content as text and is counted (`unparsed_tool_calls`): the model's text is
never dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


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


def parse_qwen3(text: str) -> ParsedOutput:
    reasoning, rest = parse_think(text)
    content, calls, bad = parse_tool_call_blocks(rest)
    return ParsedOutput(content=content, reasoning_content=reasoning, tool_calls=calls,
                        unparsed_tool_calls=bad)


def parse_chatml(text: str) -> ParsedOutput:
    content, calls, bad = parse_tool_call_blocks(text)
    return ParsedOutput(content=content, tool_calls=calls, unparsed_tool_calls=bad)


def parse_llama3(text: str) -> ParsedOutput:
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


def parse_deepseek_v3(text: str) -> ParsedOutput:
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


def parse_kimi_k2(text: str) -> ParsedOutput:
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


def parse_mistral(text: str) -> ParsedOutput:
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


def parse_glm4(text: str) -> ParsedOutput:
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


_HARMONY_HEADER = re.compile(r"(?:assistant)?\s*(?:to=([^\s<]+))?\s*<\|channel\|>\s*(\w+)"
                             r"(?:\s*to=([^\s<]+))?(?:\s*(?:<\|constrain\|>)?\s*\w+)?\s*")
_HARMONY_END = re.compile(r"(<\|end\|>|<\|call\|>|<\|return\|>)")


def parse_harmony(text: str) -> ParsedOutput:
    """gpt-oss's messages after `<|start|>assistant`: analysis -> reasoning, final (and a
    commentary preamble) -> content, commentary to=functions.NAME -> a tool call (its JSON body
    the arguments; the recipient may stand before or after the channel). Anything that is not a
    harmony message (no header, text after a message's end) is content as written."""
    if "<|channel|>" not in text:
        return ParsedOutput(content=text)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    bad = 0
    for i, message in enumerate(text.split("<|start|>")):
        raw = message if i == 0 else "<|start|>" + message
        header, sep, rest = message.partition("<|message|>")
        head = _HARMONY_HEADER.fullmatch(header) if sep else None
        if head is None:
            if raw:
                content.append(raw)
            continue
        body, *end = _HARMONY_END.split(rest, maxsplit=1)
        tail = end[1] if end else ""
        to = head.group(1) or head.group(3)
        if to is not None and to.startswith("functions."):
            try:
                json.loads(body)
            except json.JSONDecodeError:
                bad += 1
                content.append(raw)
                continue
            calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                          "function": {"name": to.removeprefix("functions."), "arguments": body}})
        elif head.group(2) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
        if tail:
            content.append(tail)
    return ParsedOutput(content="".join(content),
                        reasoning_content="\n".join(reasoning) if reasoning else None,
                        tool_calls=calls, unparsed_tool_calls=bad)


def parse_plain(text: str) -> ParsedOutput:
    return ParsedOutput(content=text)
