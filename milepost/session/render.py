"""Server-owned tokenization (report 2.4): the first turn renders the chat template to ids; later
turns render the whole history, check that it still begins with the stored turn's rendering, and
tokenize only the appended text. The model's own output tokens are never re-tokenized.

The stored rendering is cut right after the end-of-turn token of the last assistant turn (the
model stops on that token; what the template writes after it, e.g. ChatML's newline, belongs to the
suffix). An output that stopped elsewhere (a stop string, another stop id) gets the end-of-turn
token appended as a prompt token (loss mask 0): the model did not sample it.

A family whose template rewrites earlier turns' reasoning (Qwen3 drops it before the last user
message and writes an empty think block only on the last turn) keeps what the model saw: the
suffix is the template's own text after the stored turns' end-of-turn markers, once the two
renderings are shown to differ in reasoning blocks only.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from milepost.session.families import Family, FamilyError, Message, ParsedOutput

log = logging.getLogger(__name__)


class RenderError(ValueError):
    """The messages cannot be rendered, or their rendering does not extend the stored prefix."""


@dataclass
class Rendered:
    """Where a stored turn sits in the template's text: `prompt`, the rendering of the turn's
    prompt (generation prompt included), and `eots`, the end-of-turn markers the text holds up to
    the end of the turn's reply. The next turn's suffix is the template's text after that many
    markers, once its rendering is shown to begin with `prompt` (one render per turn)."""

    prompt: str
    eots: int
    end: str | None = None  # the end-of-turn marker the model stopped on, where a family has several


class Renderer:
    """Chat template + tokenizer + family, for one checkpoint."""

    def __init__(self, tokenizer: Any, family: Family) -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.template = family.chat_template  # None: the checkpoint's own
        if self.template is not None:
            log.warning("model family %r renders with its own TITO-safe chat template, not the "
                        "checkpoint's (milepost/session/family_templates.py says what it fixes)",
                        family.name)
        elif getattr(tokenizer, "chat_template", None) is None:
            raise FamilyError("session server: the checkpoint's tokenizer has no chat_template; "
                              "the session server renders messages with it")
        self.eot = family.end_of_turn or tokenizer.eos_token
        self.markers = (self.eot, *[m for m in family.turn_ends if m != self.eot])
        self.eot_ids: dict[int, str] = {}  # every end-of-turn id -> its text
        for marker in self.markers:
            ids = self.encode(marker) if marker else []
            if len(ids) != 1:
                raise FamilyError(f"model family {family.name!r}: end-of-turn {marker!r} is not "
                                  f"one token of this tokenizer ({ids}); pick the family of this "
                                  f"checkpoint")
            self.eot_ids[ids[0]] = marker
        self.eot_id = next(iter(self.eot_ids))
        self._markers = re.compile("|".join(re.escape(m) for m in self.markers))
        markers = family.think_markers
        self._think_block = (re.compile(re.escape(markers[0]) + ".*?" + re.escape(markers[1])
                                        + "\n*", re.DOTALL) if markers else None)
        # The fast path: the Rust tokenizer without transformers' per-call Python overhead.
        self._fast = getattr(tokenizer, "_tokenizer", None)

    # ---- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        fast = getattr(self, "_fast", None)
        if fast is not None:
            return fast.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ---- messages -------------------------------------------------------------------------------
    def render(self, messages: list[Message], tools: list[dict] | None,
               add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
        if self.family.tool_args_as_objects:
            messages = [args_as_objects(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt, chat_template=self.template,
                **(template_kwargs or {}))
        except Exception as e:  # jinja's own errors (raise_exception, undefined fields)
            raise RenderError(f"the chat template refused these messages: {e}") from e

    def cut_after_last_turn(self, rendered: str, next_role: str | None = None) -> str:
        """The rendering of a history that ends with an assistant turn, up to that turn's end
        (for a family whose turns end on the next message's header: that header, for a next
        message of `next_role`)."""
        if self.family.turn_end_by_next:
            return rendered + self.family.turn_end_before(next_role)
        at, marker = max((rendered.rfind(m), m) for m in self.markers)
        if at < 0:
            raise RenderError(f"the template rendered an assistant turn without its end-of-turn "
                              f"marker {self.eot!r}; model family {self.family.name!r} does not "
                              f"fit this template")
        return rendered[: at + len(marker)]

    def prompt_text(self, messages: list[Message], tools: list[dict] | None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        return self.render(messages, tools, True, template_kwargs)

    def stored_after(self, prompt: str, output_ids: list[int] | None = None) -> Rendered:
        """The place of a turn generated after `prompt` (its reply closes with one marker; with
        `output_ids`, the marker it stopped on is recorded where the family has several)."""
        end = None
        if output_ids and len(self.markers) > 1:
            end = self.eot_ids.get(output_ids[-1])
        return Rendered(prompt, len(self._markers.findall(prompt)) + 1, end)

    def prompt_and_suffix(self, stored: Rendered, ended_with_eot: bool, messages: list[Message],
                          tools: list[dict] | None,
                          template_kwargs: dict[str, Any] | None = None) -> tuple[str, str]:
        """(the template's prompt text for `messages`, the text to append after the stored turn
        so that the model sees that prompt). The stored ids stay as they are; only the suffix is
        new."""
        full = self.render(messages, tools, True, template_kwargs)
        cut, start, marker = 0, 0, None
        found = self._markers.finditer(full)
        for _ in range(stored.eots):
            m = next(found, None)
            if m is None:
                cut = -1
                break
            cut, start, marker = m.end(), m.start(), m.group()
        if cut >= 0 and full.startswith(stored.prompt):
            pass
        elif cut >= 0 and self.family.rewrites_reasoning and self.without_reasoning(
                full[:cut]).startswith(self.without_reasoning(stored.prompt)):
            pass  # earlier reasoning dropped, or an empty think block left out: what it may do
        else:
            a, b = stored.prompt, full
            if self.family.rewrites_reasoning:
                a, b = self.without_reasoning(a), self.without_reasoning(b)
                what = "by more than the reasoning the template drops"
            else:
                what = "(the template is not append-only for these messages: does it drop " \
                       "earlier reasoning?)"
            at = _first_char_difference(a, b)
            raise RenderError(
                f"the chat template's rendering of this history differs from the stored turns "
                f"{what} at character {at}: stored {a[at:at + 40]!r}, now {b[at:at + 40]!r}; did "
                f"the tools or the system prompt change?")
        if ended_with_eot and stored.end is not None and marker != stored.end:
            raise RenderError(f"the model ended its turn with {stored.end!r}, but the request "
                              f"goes on with a message the template opens with {marker!r}; send "
                              f"the kind of message the model handed the turn to")
        # A turn that stopped elsewhere (length, a stop string) gets the marker as prompt text.
        return full, full[cut:] if ended_with_eot else full[start:]

    def without_reasoning(self, text: str) -> str:
        """`text` without the family's reasoning blocks (and the newlines that follow them)."""
        return self._think_block.sub("", text) if self._think_block is not None else text

    def parse_output(self, output_ids: list[int]) -> ParsedOutput:
        ids = output_ids[:-1] if output_ids and output_ids[-1] in self.eot_ids else output_ids
        return self.family.parse(self.decode(ids))


def normalize_messages(messages: list[Message]) -> list[Message]:
    """The fields a chat template reads, in the shape templates expect: content as a string (text
    parts joined; None -> ""), tool-call arguments as JSON strings. Other fields are kept."""
    out = []
    for m in messages:
        m = dict(m)
        content = m.get("content")
        if content is None:
            m["content"] = ""
        elif isinstance(content, list):
            m["content"] = "".join(p.get("text", "") for p in content)
        out.append(m)
    return out


def _first_char_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def args_as_objects(m: Message) -> Message:
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = dict(c.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # the template shows what the model wrote
        calls.append({**c, "function": fn})
    return {**m, "tool_calls": calls}
