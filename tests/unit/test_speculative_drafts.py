"""N-gram proposals, and the speculative settings refused at start (engine and benchmark)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.bench.args import BenchArgs
from milepost.engine.draft_ngram import NgramDrafter
from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs


def req(prompt: list[int], output: list[int] = ()) -> Request:
    r = Request(rid="r", prompt_ids=list(prompt), params=SamplingParams(), on_output=lambda o: None,
                stop_ids=frozenset())
    r.output_ids.extend(output)
    return r


def test_the_longest_matching_tail_wins_and_its_latest_occurrence() -> None:
    d = NgramDrafter(1, 4)
    # tail [1, 2]: after "1 2" came 3 (early) and 9 (latest); tail "5 1 2" matched once, with 7.
    r = req([5, 1, 2, 7, 8, 1, 2, 9, 4, 5, 1, 2])
    assert d.propose(r, 3) == [7, 8, 1]
    r = req([1, 2, 3, 6, 1, 2, 9, 4, 1, 2])
    assert d.propose(r, 2) == [9, 4]  # no 3-gram repeats: the latest "1 2"


def test_proposals_follow_the_output_as_it_grows() -> None:
    d = NgramDrafter(2, 3)
    r = req([10, 11, 12, 13], [20])
    assert d.propose(r, 3) == []  # the tail "13 20" never occurred
    r.output_ids.extend([10, 11])
    assert d.propose(r, 3) == [12, 13, 20]
    r.output_ids.extend([12, 99])
    assert d.propose(r, 3) == []
    assert d.propose(r, 0) == []


def test_a_loop_is_continued_past_the_end_of_the_sequence() -> None:
    d = NgramDrafter(1, 3)
    assert d.propose(req([4, 4, 4]), 5) == [4, 4, 4, 4, 4]
    assert d.propose(req([1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]


def test_match_window_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="min .* <= max"):
        NgramDrafter(3, 2)


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "max_position_embeddings": 128}))
    return tmp_path


@pytest.mark.parametrize("flags, message", [
    ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
    ({"speculative_num_draft_tokens": 6}, "need --speculative-algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5,
      "speculative_ngram_max_match_window_size": 3}, "min-match-window-size exceeds"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, "greater than or equal to 2"),
])
def test_settings_refused_at_start(model_dir: Path, flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path=model_dir, **flags)


def test_draft_dir_checks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    other = tmp_path_factory.mktemp("draft")
    with pytest.raises(ValueError, match="no config.json"):
        ServerArgs(model_path=model_dir, speculative_algorithm="STANDALONE",
                   speculative_draft_model_path=other)
    (other / "config.json").write_text(json.dumps({"vocab_size": 64}))
    with pytest.raises(ValueError, match="NGRAM uses no draft model"):
        ServerArgs(model_path=model_dir, speculative_algorithm="NGRAM",
                   speculative_draft_model_path=other)
    # Same vocab_size but a tokenizer that maps tokens to other ids: refused too.
    for d, vocab in ((model_dir, {"a": 0, "b": 1}), (other, {"a": 1, "b": 0})):
        (d / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(ValueError, match="other ids than the target's"):
        ServerArgs(model_path=model_dir, speculative_algorithm="STANDALONE",
                   speculative_draft_model_path=other)
    (other / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    args = ServerArgs(model_path=model_dir, speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=other).resolved()
    assert args.overlap_schedule == "off"  # auto: proposals need each step's tokens
    with pytest.raises(ValueError, match="STANDALONE needs each step's tokens .* drop --overlap-schedule on"):
        ServerArgs(model_path=model_dir, speculative_algorithm="STANDALONE",
                   speculative_draft_model_path=other, overlap_schedule="on")
    # NGRAM takes the overlap schedule for the steps it rests (speculative.py's back-off)
    assert ServerArgs(model_path=model_dir, speculative_algorithm="NGRAM",
                      overlap_schedule="on").overlap_schedule == "on"


def test_bench_speculative_flag(model_dir: Path) -> None:
    assert BenchArgs(shape="tiny", speculative="ngram").speculative == "ngram"
    assert BenchArgs(shape="tiny", speculative=f"draft:{model_dir}").speculative.endswith(str(model_dir))
    for bad in ("eagle", "draft:", f"draft:{model_dir / 'missing'}"):
        with pytest.raises(ValueError, match="--speculative"):
            BenchArgs(shape="tiny", speculative=bad)


def test_requests_whose_sampling_reads_each_token_decode_without_proposals() -> None:
    from milepost.engine.speculative import Speculator

    def make(**params: object) -> Request:
        return Request(rid="r", prompt_ids=[1, 2], params=SamplingParams(**params),
                       on_output=lambda o: None, stop_ids=frozenset())

    assert Speculator.eligible(make(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1))
    assert not Speculator.eligible(make(frequency_penalty=0.5))
    assert not Speculator.eligible(make(repetition_penalty=1.2))
    assert not Speculator.eligible(make(logit_bias={"5": 2.0}))
    r = make(min_new_tokens=2)
    assert not Speculator.eligible(r)  # its stop tokens are banned until 2 tokens are out
    r.output_ids.extend([7, 8])
    assert Speculator.eligible(r)
    r.grammar = object()  # any grammar matcher: its mask follows every token
    assert not Speculator.eligible(r)
    with pytest.raises(ValueError, match="num-draft-tokens must be >= 2"):
        Speculator(1, NgramDrafter(1, 2))


def test_verify_and_draft_chunks_lay_out_their_proposed_tokens() -> None:
    import numpy as np

    from milepost.engine.forward_batch import DecodeBuffers, build_flat, fill_decode
    from milepost.engine.scheduler import Chunk

    r = req([3, 4, 5], [6, 8])  # total_len 5: the last token (8) sits at position 4
    r.blocks = [1, 9]
    verify = Chunk(r, 4, 3, draft=[11, 12], verify=True)
    assert verify.samples and verify.logit_rows == 3
    flat = build_flat([verify], 4)
    assert flat.input_ids.tolist() == [8, 11, 12]
    assert flat.positions.tolist() == [4, 5, 6] and flat.sample_rows == [0, 1, 2]
    assert flat.slots.tolist() == [9 * 4, 9 * 4 + 1, 9 * 4 + 2]
    # The draft model's second step: its first proposal (11) at position 5, one logits row.
    step = Chunk(r, 5, 1, draft=[11])
    assert step.samples and step.logit_rows == 1
    assert build_flat([step], 4).input_ids.tolist() == [11]
    host = np.zeros(2 * (4 + 2), dtype=np.int32)
    buf = DecodeBuffers.over(host, 2, 2)
    fill_decode(buf, [step], 2, 4)
    assert buf.ids[:2].tolist() == [11, 0] and buf.positions[:1].tolist() == [5]
    assert buf.slots[:2].tolist() == [9 * 4 + 1, -1]
