"""Token-by-token stream deltas: for every family and every cut of an output, what was streamed
is a prefix of the final parse, text arrives before the turn ends, and the deltas plus `finish`
add up to exactly the stored reply."""

from __future__ import annotations

import itertools

import pytest

from milepost.session.families import get_family
from milepost.session.openai_chat import IncrementalText
from milepost.session.streaming import DeltaStream
from milepost.testing.tokenizer import build_tiny_tokenizer

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
KIMI_CALL = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
             '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
             "<|tool_calls_section_end|>")
MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}]'
GLM_CALL = ("\n<think>Need it.</think>\nChecking.\n<tool_call>get_weather\n<arg_key>city</arg_key>"
            "\n<arg_value>Oslo</arg_value>\n</tool_call>")
HARMONY_ANSWER = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
                  "final<|message|>It snows.")
HARMONY_CALL = ("<|channel|>analysis<|message|>Call.<|end|><|start|>assistant to=functions."
                'get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}')
OUTPUTS = [
    ("qwen3", "<think>\nneed the weather\n</think>\n\nLet me check.\n" + CALL),
    ("qwen3", "\n<think>\nhmm\n\n</think>\nIt is sunny in Oslo today.\n\n"),
    ("qwen3", "<think>\ncut by the length limit, never clo"),
    ("qwen3", "Plain answer with a < sign and <tool_c that is not a call."),
    ("qwen3", "Before <tool_call>{not json}</tool_call> after\n" + CALL),
    ("qwen3", "<tool_call>{bad}</tool_call>"),
    ("chatml", 'Sure.\n<tool_call>[{"name": "a", "arguments": {"x": 1}}]</tool_call>'),
    ("chatml", "<think>not special here</think> text \u00e9\u4e2d"),
    ("generic", "anything <tool_call> goes\n\n"),
    ("kimi-k2", KIMI_CALL),
    ("mistral", " It is sunny in Oslo."),
    ("mistral", MISTRAL_CALL),
    ("glm4", GLM_CALL),
    ("glm4", "\n<think></think>\nIt is sunny."),
    ("gpt-oss", HARMONY_ANSWER),
    ("gpt-oss", HARMONY_CALL),
    ("gpt-oss", "<|channel|>final<|message|>Direct answer."),
]


def _replay(family: str, text: str, step: int = 1) -> tuple[list[dict], dict, list[int]]:
    fam = get_family(family)
    stream = DeltaStream(fam)
    deltas: list[dict] = []
    sent_at: list[int] = []  # text length at each update that sent something
    for cut in range(0, len(text) + 1, step):
        got = stream.update(text[:cut])
        deltas += got
        if got:
            sent_at.append(cut)
    reply = fam.parse(text).message()
    deltas += stream.finish(reply)
    assert stream.consistent
    return deltas, reply, sent_at


@pytest.mark.parametrize("family,text", OUTPUTS)
def test_deltas_add_up_to_the_parsed_reply(family: str, text: str) -> None:
    deltas, reply, _ = _replay(family, text)
    joined = {f: "".join(d.get(f, "") for d in deltas) for f in ("reasoning_content", "content")}
    assert joined["content"] == reply["content"]
    assert joined["reasoning_content"] == (reply.get("reasoning_content") or "")
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["id"] for c in calls] == [c["id"] for c in reply.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))


def test_text_streams_before_the_turn_ends() -> None:
    text = "<think>\nlong reasoning here\n</think>\n\nThe answer is forty two, as computed."
    deltas, _, sent_at = _replay("qwen3", text)
    # reasoning and content both arrive in several pieces, long before the whole text is there
    assert sum("reasoning_content" in d for d in deltas) > 3
    assert sum("content" in d for d in deltas) > 3
    assert sent_at[0] < len(text) // 3


def test_markers_are_held_back_until_decided() -> None:
    stream = DeltaStream(get_family("qwen3"))
    assert stream.update("<thi") == []  # may still open a think block
    stream = DeltaStream(get_family("qwen3"))
    assert stream.update("Hi <tool_") == [{"content": "Hi "}]
    assert stream.update("Hi <tool_call>{\"name\"") == []  # a call: never streamed as content
    assert stream.update("Hi\ufffd") == []  # no new stable text


def test_incremental_text_equals_a_whole_decode() -> None:
    tok = build_tiny_tokenizer()
    text = "Weather in Zürich? \u4e2d\u6587 <think>ok</think> done.\n\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    inc = IncrementalText(lambda x: tok.decode(x, skip_special_tokens=False))
    seen = [inc.update(ids[:k]) for k in range(1, len(ids) + 1)]
    assert seen[-1] == tok.decode(ids, skip_special_tokens=False)
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))
    assert all("\ufffd" not in s for s in seen)


# Pieces of every family's formats, glued at random: a parser never raises, its calls carry an
# id, a name and JSON arguments, and the stream's deltas stay a prefix of the parse.
PIECES = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
          "<arg_value>", "</arg_value>", "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
          "functions.get_weather:0", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
          "[TOOL_CALLS]", " [", "]", "{", "}", '"name"', ":", '"get_weather"', ",", '"arguments"',
          "<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>",
          "assistant", " to=functions.get_weather", "<|call|>", "<|constrain|>json", "\n", " ",
          "text", "\u00e9", '{"name": "f"}', "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
          "<｜tool▁sep｜>", "\n```json\n", "\n```", "<｜tool▁call▁end｜>", "<|python_tag|>",
          '{"name": "f", "parameters": {}}')


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "llama3", "deepseek-v3", "kimi-k2",
                                    "mistral", "glm4", "gpt-oss", "chatml"])
def test_random_marker_soup_never_breaks_a_parser_or_its_stream(family: str) -> None:
    import json
    import random

    fam = get_family(family)
    rng = random.Random(family)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 12)))
        reply = fam.parse(text).message()
        stream = DeltaStream(fam)
        for cut in range(len(text) + 1):
            stream.update(text[:cut])
        stream.finish(reply)
        assert stream.consistent, text
        for call in reply.get("tool_calls", []):
            assert call["id"] and call["function"]["name"], text
            json.loads(call["function"]["arguments"])
