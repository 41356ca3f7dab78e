"""Model families (report 2.4.3): one chat template handling + one reasoning parser + one tool-call
parser, registered under a name the user gives at launch (a family is never detected from the
checkpoint). The template itself is the checkpoint's own (its tokenizer's `chat_template`); the
family says how to read the model's output back into a message and where an assistant turn ends.

Registered: `qwen3` (`<think>` reasoning the template drops from earlier turns,
`<tool_call>{json}</tool_call>`), `qwen2.5`, `llama3` (3.1 / 3.2), `kimi-k2`, `glm4` (turns end on
the next message's header), `deepseek-v3`, `mistral` and `gpt-oss` (each with its own TITO-safe
template: family_templates.py), `chatml` (SmolLM2 and other plain ChatML checkpoints), and
`generic` (no parsers; warns that incremental tokenization may diverge). The parsers are in
parsers.py; docs/sessions.md has the table of what each family knows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from milepost.session.family_templates import (
    DEEPSEEK_V3_TITO,
    GPT_OSS_TITO,
    MISTRAL_TEKKEN_TITO,
    MISTRAL_TITO,
)
from milepost.session.parsers import (  # noqa: F401 - Message, ParsedOutput, parse_* re-exported
    Message,
    ParsedOutput,
    parse_chatml,
    parse_deepseek_v3,
    parse_glm4,
    parse_harmony,
    parse_kimi_k2,
    parse_llama3,
    parse_mistral,
    parse_plain,
    parse_qwen3,
    parse_think,
    parse_tool_call_blocks,
)

log = logging.getLogger(__name__)


class FamilyError(ValueError):
    """The family name, or its template on this checkpoint, cannot serve a session."""


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
    tool_call_open: str | tuple[str, ...] | None = None
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


register_family(Family("qwen3", "<|im_end|>", parse_qwen3,
                       description="Qwen3 (thinking, hybrid and instruct-2507 checkpoints): "
                       "<think> reasoning, dropped from earlier turns by the template; "
                       "<tool_call> JSON",
                       think_markers=("<think>", "</think>"), tool_call_open="<tool_call>",
                       rewrites_reasoning=True))
register_family(Family("qwen2.5", "<|im_end|>", parse_chatml,
                       description="Qwen2.5 Instruct: ChatML, <tool_call> JSON, arguments "
                       "rendered as objects", tool_call_open="<tool_call>",
                       tool_args_as_objects=True))
register_family(Family("llama3", "<|eot_id|>", parse_llama3,
                       description="Llama 3.1 / 3.2 Instruct: header-id turns; a tool call is "
                       "the whole reply as JSON {name, parameters}; tool results as ipython; "
                       "one call per turn", tool_call_open=('{"name"', "<|python_tag|>"),
                       tool_args_as_objects=True,
                       parallel_tool_calls=False))
register_family(Family("deepseek-v3", "<｜end▁of▁sentence｜>", parse_deepseek_v3,
                       description="DeepSeek-V3 (0324): <｜tool▁calls▁begin｜> sections; renders "
                       "with its own TITO-safe template (the published one cannot close a lone "
                       "tool call)", tool_call_open="<｜tool▁calls▁begin｜>",
                       chat_template=DEEPSEEK_V3_TITO))
register_family(Family("kimi-k2", "<|im_end|>", parse_kimi_k2,
                       description="Kimi K2 Instruct: <|im_user|>/<|im_assistant|> headers, "
                       "<|tool_calls_section_begin|> sections with functions.NAME:IDX ids",
                       tool_call_open="<|tool_calls_section_begin|>"))
register_family(Family("mistral", "</s>", parse_mistral,
                       description="Mistral Instruct v3 / tekken: [INST] turns, [TOOL_CALLS] JSON "
                       "lists with 9-character ids; renders with its own TITO-safe template (the "
                       "published one moves the system prompt and tools to the last user turn)",
                       tool_call_open="[TOOL_CALLS]", tool_args_as_objects=True,
                       chat_template=MISTRAL_TITO))
register_family(Family("mistral-tekken", "</s>", parse_mistral,
                       description="Mistral tekken checkpoints (Nemo and later, v3 layout without "
                       "the spaces after control tokens): as mistral, with its own TITO-safe "
                       "template", tool_call_open="[TOOL_CALLS]", tool_args_as_objects=True,
                       chat_template=MISTRAL_TEKKEN_TITO))
register_family(Family("glm4", "<|user|>", parse_glm4,
                       description="GLM-4.5 / 4.6: turns end on the next message's header "
                       "(<|user|> or <|observation|>); <think> reasoning shown only after the last "
                       "user message; <tool_call>NAME with <arg_key>/<arg_value> pairs",
                       think_markers=("<think>", "</think>"), tool_call_open="<tool_call>",
                       rewrites_reasoning=True, tool_args_as_objects=True,
                       turn_end_by_next=(("tool", "<|observation|>"), ("", "<|user|>"))))
register_family(Family("gpt-oss", "<|return|>", parse_harmony,
                       description="gpt-oss (harmony): analysis / final / commentary channels, one "
                       "tool call per turn ending on <|call|>; renders with its own TITO-safe "
                       "template (the published one rewrites <|return|> to <|end|> and drops "
                       "analysis in history)",
                       think_markers=("<|channel|>analysis<|message|>", "<|end|>"),
                       # every later harmony header holds the content back until the turn ends
                       tool_call_open="<|", tool_args_as_objects=True, parallel_tool_calls=False,
                       more_turn_ends=("<|call|>",), chat_template=GPT_OSS_TITO))
register_family(Family("chatml", "<|im_end|>", parse_chatml,
                       description="ChatML (SmolLM2): <tool_call> JSON in the text",
                       tool_call_open="<tool_call>"))
register_family(Family("generic", "", parse_plain, checked=False,
                       description="any template; no parsers; turn end from the tokenizer's EOS"))
