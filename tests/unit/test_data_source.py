"""PromptDataset: JSONL and Parquet rows, chat vs text prompts, bad rows, seeded order, resume, requeue."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from milepost.data.source import DatasetError, DataSource, PromptDataset
from milepost.testing.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": f"What is {i}+1?", "label": str(i + 1), "metadata": {"id": i}} for i in range(10)]


def test_jsonl_text_prompt_gets_chat_template(tmp_path, tok):
    ds = PromptDataset.from_file(write_jsonl(tmp_path / "d.jsonl", ROWS), tok, shuffle=False)
    assert len(ds) == 10
    item = ds.items[3]
    expected = tok.apply_chat_template([{"role": "user", "content": "What is 3+1?"}],
                                       tokenize=True, add_generation_prompt=True)["input_ids"]
    assert item.prompt_ids == list(expected)
    assert item.prompt == "What is 3+1?" and item.label == "4" and item.metadata == {"id": 3}
    assert item.index == 3
    # the template wrote <|im_start|> once: no special token was added twice
    assert item.prompt_ids[0] == 1 and item.prompt_ids.count(1) == 2


def test_chat_messages_and_plain_text(tmp_path, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rows = [{"question": msgs, "answer": 1}]
    ds = PromptDataset.from_file(write_jsonl(tmp_path / "c.jsonl", rows), tok,
                                 input_key="question", label_key="answer", shuffle=False)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert ds.items[0].prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ds.items[0].prompt == msgs and ds.items[0].label == 1

    plain = PromptDataset.from_file(write_jsonl(tmp_path / "p.jsonl", ROWS[:2]), tok,
                                    apply_chat_template=False, shuffle=False)
    assert plain.items[1].prompt_ids == tok.encode("What is 1+1?")


def test_chat_template_kwargs_and_max_prompt_len(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hi", "label": 0},
                                              {"prompt": "Hi " * 50, "label": 0}])
    ds = PromptDataset.from_file(path, tok, chat_template_kwargs={"enable_thinking": False},
                                 max_prompt_len=30, shuffle=False)
    assert len(ds) == 1 and ds.items[0].index == 0  # the long prompt is dropped, indices stable
    assert tok.decode(ds.items[0].prompt_ids).endswith("<think>\n\n</think>\n\n")


def test_parquet(tmp_path, tok):
    msgs = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    table = pa.table({"prompt": msgs, "label": ["a", "b", "c"],
                      "metadata": [json.dumps({"k": i}) for i in range(3)]})
    pq.write_table(table, tmp_path / "d.parquet")
    ds = PromptDataset.from_file(tmp_path / "d.parquet", tok, shuffle=False)
    assert [it.label for it in ds.items] == ["a", "b", "c"]
    assert ds.items[2].metadata == {"k": 2}  # metadata stored as JSON text is parsed
    assert ds.items[2].prompt == msgs[2]
    assert tok.decode(ds.items[2].prompt_ids) == "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n"

    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(DatasetError, match=r"bad\.parquet:row 0: no 'prompt' field"):
        PromptDataset.from_file(tmp_path / "bad.parquet", tok)


@pytest.mark.parametrize("rows, kwargs, match", [
    ([{"prompt": "a", "label": 1}, {"text": "b", "label": 2}], {}, r"line 2: no 'prompt' field"),
    ([{"prompt": "a", "label": 1}, {"prompt": "b"}], {}, r"line 2: no 'label' field"),
    ([{"prompt": 3, "label": 1}], {}, r"line 1: prompt must be text or a list of chat messages"),
    ([{"prompt": [{"content": "x"}], "label": 1}], {}, r"line 1: prompt\[0\] is not a chat message"),
    ([{"prompt": [{"role": "user", "content": "x"}], "label": 1}], {"apply_chat_template": False},
     r"line 1: prompt is a list of chat messages but apply_chat_template is off"),
    ([{"prompt": [{"role": "robot", "content": "x"}], "label": 1}], {},
     r"line 1: the chat template refused this prompt: Unknown role"),
    ([{"prompt": "a", "label": 1, "metadata": [1]}], {}, r"line 1: metadata must be an object"),
])
def test_bad_rows_name_file_line_and_key(tmp_path, tok, rows, kwargs, match):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match=match) as e:
        PromptDataset.from_file(path, tok, **kwargs)
    assert str(path) in str(e.value)


def test_bad_files(tmp_path, tok):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "label": 1}\n\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"broken\.jsonl:line 3: not valid JSON"):
        PromptDataset.from_file(tmp_path / "broken.jsonl", tok)
    with pytest.raises(DatasetError, match="no such dataset file"):
        PromptDataset.from_file(tmp_path / "missing.jsonl", tok)
    (tmp_path / "d.csv").write_text("prompt\n")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        PromptDataset.from_file(tmp_path / "d.csv", tok)
    # rows without labels are fine when the run says there are none
    path = write_jsonl(tmp_path / "nolabel.jsonl", [{"prompt": "a"}])
    assert PromptDataset.from_file(path, tok, label_key=None).items[0].label is None


def _indices(batch):
    return [it.index for it in batch]


def test_seeded_epochs_and_resume(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    a = PromptDataset.from_file(path, tok, seed=7)
    b = PromptDataset.from_file(path, tok, seed=7)
    first = [_indices(a.next_batch(4)) for _ in range(6)]  # 24 prompts: 2.4 epochs
    assert first == [_indices(b.next_batch(4)) for _ in range(6)]
    flat = [i for batch in first for i in batch]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # each epoch gets its own order
    assert flat[:10] != list(range(10))
    assert a.epoch == 2 and a.offset == 4
    other = PromptDataset.from_file(path, tok, seed=8)
    assert _indices(other.next_batch(10)) != flat[:10]

    # resume: a fresh dataset loaded with the state continues exactly where `a` is
    c = PromptDataset.from_file(path, tok, seed=0)
    c.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [_indices(c.next_batch(3)) for _ in range(5)] == [_indices(a.next_batch(3)) for _ in range(5)]

    no_shuffle = PromptDataset.from_file(path, tok, shuffle=False)
    assert _indices(no_shuffle.next_batch(12)) == list(range(10)) + [0, 1]


def test_requeue_first_counted_and_resumed(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    ds = PromptDataset.from_file(path, tok, shuffle=False)
    batch = ds.next_batch(4)
    ds.requeue(batch[1:3])
    assert ds.num_requeued == 2 and ds.num_pending_retries == 2
    state = ds.state_dict()
    nxt = ds.next_batch(3)
    assert _indices(nxt) == [1, 2, 4]  # retried prompts first, then the epoch goes on
    assert ds.num_pending_retries == 0 and ds.num_requeued == 2

    resumed = PromptDataset.from_file(path, tok, shuffle=False)
    resumed.load_state_dict(state)
    assert _indices(resumed.next_batch(3)) == [1, 2, 4]
    assert resumed.num_requeued == 2

    smaller = PromptDataset.from_file(write_jsonl(tmp_path / "s.jsonl", ROWS[:5]), tok)
    with pytest.raises(DatasetError, match="resume with the same prompt data"):
        smaller.load_state_dict(state)
    assert isinstance(ds, DataSource)
    with pytest.raises(ValueError, match="n must be >= 1"):
        ds.next_batch(0)
