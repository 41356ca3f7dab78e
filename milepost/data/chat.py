"""Chat datasets for supervised fine-tuning: messages -> token ids + a mask of the assistant tokens.

Each assistant turn's tokens are what the chat template adds between the conversation before it
(rendered with the generation prompt) and the conversation including it: the reply and its end
marker, never the prompt. Those spans are found by rendering prefixes, and the full rendering must
extend every prefix token for token; a template for which that fails is refused, naming the row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class ChatDataError(ValueError):
    """A row of a chat dataset that cannot be trained on; the message names file, line and why."""


@dataclass
class ChatExample:
    """tokens: [n] ids of the whole rendered conversation; mask: [n] 1 on assistant tokens."""

    tokens: list[int]
    mask: list[int]


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def tokenize_chat(tokenizer: Any, messages: list[dict], where: str = "messages") -> ChatExample:
    """Token ids of the conversation and the assistant-token mask (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: expected a non-empty list of {{role, content}} messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ChatDataError(f"{where}: every message needs a role in {ROLES} and a string content, got {m!r}")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where}: no assistant message, so nothing to learn")
    full = _render(tokenizer, messages, False)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else []
        upto = _render(tokenizer, messages[: i + 1], False)
        if full[: len(upto)] != upto or upto[: len(before)] != before or len(upto) <= len(before):
            raise ChatDataError(
                f"{where}: the chat template does not render message {i} as an extension of the "
                "conversation before it, so its tokens cannot be masked exactly"
            )
        for t in range(len(before), len(upto)):
            mask[t] = 1
    return ChatExample(full, mask)


def load_chat_dataset(
    path: str | Path, tokenizer: Any, *, messages_key: str = "messages", max_seq_len: int | None = None
) -> tuple[list[ChatExample], int]:
    """Every row of a JSONL file of conversations; returns (examples, how many were truncated to
    max_seq_len). A row whose assistant tokens all fall beyond max_seq_len is refused."""
    path = Path(path)
    if not path.is_file():
        raise ChatDataError(f"--sft-data {path} does not exist; pass a JSONL file of {{'{messages_key}': [...]}} rows")
    examples, truncated = [], 0
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ChatDataError(f"{where}: not JSON ({e})") from None
            if not isinstance(row, dict) or messages_key not in row:
                raise ChatDataError(f"{where}: no {messages_key!r} field (set --messages-key)")
            ex = tokenize_chat(tokenizer, row[messages_key], where)
            if max_seq_len is not None and len(ex.tokens) > max_seq_len:
                ex = ChatExample(ex.tokens[:max_seq_len], ex.mask[:max_seq_len])
                truncated += 1
            if not any(ex.mask[1:]):
                raise ChatDataError(f"{where}: no assistant token within --max-seq-len {max_seq_len}")
            examples.append(ex)
    if not examples:
        raise ChatDataError(f"--sft-data {path} has no rows")
    return examples, truncated
