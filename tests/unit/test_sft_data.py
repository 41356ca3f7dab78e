"""Chat tokenization for SFT: the loss mask covers exactly the assistant replies and their end markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.data.chat import ChatDataError, load_chat_dataset, tokenize_chat
from milepost.testing.tokenizer import build_tiny_tokenizer
from milepost.train.sft import epoch_order, examples_batch


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def masked_text(tok, ex) -> list[str]:
    """The decoded runs of consecutive masked tokens."""
    runs, cur = [], []
    for t, m in zip(ex.tokens, ex.mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_mask_is_the_assistant_turns_of_a_multi_turn_conversation(tok) -> None:
    messages = [
        {"role": "system", "content": "be exact"},
        {"role": "user", "content": "23+45="},
        {"role": "assistant", "content": "68"},
        {"role": "user", "content": "10+10="},
        {"role": "assistant", "content": "20"},
    ]
    ex = tokenize_chat(tok, messages)
    assert tok.decode(ex.tokens) == tok.apply_chat_template(messages, tokenize=False)
    assert masked_text(tok, ex) == ["68<|im_end|>\n", "20<|im_end|>\n"]
    batch = examples_batch([ex])
    assert batch.response_lengths == [len(ex.tokens) - 1]
    assert batch.loss_masks[0].tolist() == [float(m) for m in ex.mask[1:]]  # token t+1 predicted from row t


def test_bad_rows_are_refused_naming_file_and_line(tok, tmp_path: Path) -> None:
    with pytest.raises(ChatDataError, match="no assistant message"):
        tokenize_chat(tok, [{"role": "user", "content": "hi"}])
    with pytest.raises(ChatDataError, match="role"):
        tokenize_chat(tok, [{"role": "robot", "content": "hi"}])
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"msgs": []}) + "\n")
    with pytest.raises(ChatDataError, match=r"chat.jsonl:2: no 'messages' field"):
        load_chat_dataset(path, tok)
    path.write_text(json.dumps(good) + "\n")
    examples, truncated = load_chat_dataset(path, tok, max_seq_len=18)
    assert truncated == 1 and len(examples[0].tokens) == 18 and sum(examples[0].mask) == 2
    with pytest.raises(ChatDataError, match="no assistant token within"):
        load_chat_dataset(path, tok, max_seq_len=16)


def test_epoch_order_is_a_seeded_permutation() -> None:
    a, b = epoch_order(10, 1, 0), epoch_order(10, 1, 1)
    assert sorted(a) == list(range(10)) and a == epoch_order(10, 1, 0) and a != b
