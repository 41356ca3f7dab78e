"""Model families: output parsers, the append-only CPU check, refusal of templates that fail it."""

from __future__ import annotations

import logging

import pytest

from milepost.session.checks import check_append_only, require_append_only
from milepost.session.families import FamilyError, get_family
from milepost.session.render import Renderer, RenderError
from milepost.testing.tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

# SmolLM2-135M-Instruct's own template (plain ChatML, no tools, default system prompt).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# Like the real Qwen3 template: reasoning of assistant turns before the last user turn is dropped.
DROPS_REASONING = CHAT_TEMPLATE.replace(
    "{%- if message.get('reasoning_content') %}",
    "{%- if message.get('reasoning_content') and loop.index0 > "
    "(messages | map(attribute='role') | list | join(',')).count('user') %}")


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _renderer(tok, family: str, template: str | None = None) -> Renderer:
    tok = tok.__class__(tokenizer_object=tok._tokenizer, **{
        k: getattr(tok, k) for k in ("eos_token", "pad_token")})
    tok.chat_template = template or CHAT_TEMPLATE
    return Renderer(tok, get_family(family))


def test_qwen3_parses_reasoning_and_tool_calls() -> None:
    out = get_family("qwen3").parse(
        '<think>\nneed weather\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": '
        '{}}\n</tool_call>')
    assert out.reasoning_content == "need weather"
    assert out.content == "Let me check."
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather", "f"]
    assert out.tool_calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert out.tool_calls[0]["id"] != out.tool_calls[1]["id"]


def test_malformed_tool_call_stays_in_content() -> None:
    text = "<tool_call>{not json}</tool_call>"
    out = get_family("qwen3").parse(text)
    assert out.tool_calls == [] and out.content == text
    assert out.unparsed_tool_calls == 1  # counted: rollout/session_unparsed_tool_calls
    good = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert get_family("qwen3").parse(good + text).unparsed_tool_calls == 1
    assert get_family("qwen3").parse(good).unparsed_tool_calls == 0


def test_chatml_reads_smollm2_list_calls() -> None:
    out = get_family("chatml").parse('<tool_call>[{"name": "a", "arguments": {"x": 1}}, '
                                     '{"name": "b", "arguments": {}}]</tool_call>')
    assert [c["function"]["name"] for c in out.tool_calls] == ["a", "b"]
    assert out.reasoning_content is None


@pytest.mark.parametrize("family,template", [("qwen3", None), ("chatml", SMOLLM2_TEMPLATE),
                                             ("generic", SMOLLM2_TEMPLATE)])
def test_registered_families_pass_the_append_only_battery(tok, family, template) -> None:
    results = check_append_only(_renderer(tok, family, template))
    assert len(results) >= 5
    assert all(r.ok for r in results), [r for r in results if not r.ok]


def test_template_that_drops_reasoning_needs_a_family_that_knows_it(tok) -> None:
    # qwen3 registers the reasoning drop (tests/unit/test_session_qwen_templates.py: the real one)
    assert all(c.ok for c in check_append_only(_renderer(tok, "qwen3", DROPS_REASONING)))
    r = _renderer(tok, "chatml", DROPS_REASONING)
    failed = [c.name for c in check_append_only(r) if not c.ok]
    assert "reasoning every turn" in failed
    assert "multi-turn chat" not in failed  # the battery pinpoints what breaks
    with pytest.raises(RenderError, match="not append-only"):
        require_append_only(r)


def test_generic_family_warns(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        get_family("generic")
    assert "may diverge" in caplog.text


def test_unknown_family_names_the_setting() -> None:
    with pytest.raises(FamilyError, match="session_model_family.*qwen3"):
        get_family("llama-9")


def test_end_of_turn_must_be_one_token(tok) -> None:
    from dataclasses import replace

    fam = replace(get_family("qwen3"), end_of_turn="<|not a token|>")
    with pytest.raises(FamilyError, match="not one token"):
        Renderer(tok, fam)
