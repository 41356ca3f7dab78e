"""The tiny test tokenizer: byte-exact round trips, fixed special ids, chat template, determinism."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from milepost.testing.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer, save_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _random_text(rng: random.Random, n: int) -> str:
    # Mix ASCII, Latin-1, CJK, emoji (astral plane) and control/whitespace characters.
    ranges = [(0x09, 0x0D), (0x20, 0x7E), (0xA0, 0x24F), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F)]
    out = []
    for _ in range(n):
        lo, hi = rng.choice(ranges)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def test_round_trip_arbitrary_text(tok):
    rng = random.Random(0)
    samples = [_random_text(rng, rng.randint(1, 80)) for _ in range(200)]
    samples += ["", " ", "  leading and trailing  ", "a\r\nb\n\n\tc", "What is 3+4?", "naïve café 你好 🎉"]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s


def test_every_id_below_vocab_size():
    for vocab_size in (263, 300, 512, 1024):
        t = build_tiny_tokenizer(vocab_size)
        assert len(t) <= vocab_size
        assert max(t.get_vocab().values()) < vocab_size
        rng = random.Random(vocab_size)
        ids = t.encode(_random_text(rng, 500), add_special_tokens=False)
        assert max(ids) < vocab_size


def test_default_fills_vocab_and_learns_merges(tok):
    assert len(tok) == 512
    # Merges were learned from the corpus: a common word is one token, digits stay single.
    assert tok.tokenize(" answer") == ["Ġanswer"]
    assert tok.tokenize("123") == ["1", "2", "3"]


def test_too_small_vocab_is_refused():
    with pytest.raises(ValueError, match="vocab_size must be >= 263"):
        build_tiny_tokenizer(200)


def test_special_ids_fixed(tok):
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(s) == i
        assert tok.encode(s, add_special_tokens=False) == [i]
    assert tok.pad_token_id == 0 and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.bos_token is None
    # No BOS or EOS is added implicitly.
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3+4?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3+4?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n")
    no_think = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == 1 and ids.count(2) == 2


def test_chat_template_assistant_tools_and_reasoning(tok):
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need tool",
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": "X"}}}],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "warm"},
        {"role": "assistant", "content": "Sunny and warm."},
    ]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {}}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "w"' in text.split("<|im_end|>")[0]
    assert (
        "<|im_start|>assistant\n<think>\nneed tool\n</think>\n\n"
        '<tool_call>\n{"name": "w", "arguments": {"c": "X"}}\n</tool_call><|im_end|>\n'
    ) in text
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nwarm\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\nSunny and warm.<|im_end|>\n")
    with pytest.raises(Exception, match="Unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_save_and_load_with_auto_tokenizer(tok, tmp_path: Path):
    save_tiny_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    a = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    b = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert a == b and a.endswith("<|im_start|>assistant\n")
    s = "Tokens: 你好, 🎉, <think>x</think>"
    assert loaded.encode(s) == tok.encode(s)
    assert loaded.decode(loaded.encode(s)) == s
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.bos_token_id) == (2, 0, None)
    assert len(loaded) == len(tok)


def test_deterministic_across_builds(tmp_path: Path):
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    save_tiny_tokenizer(tmp_path / "a")
    save_tiny_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
