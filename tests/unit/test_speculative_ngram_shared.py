"""The n-gram drafter's shared scopes: proposals from other requests with the same prompt (prompt)
or from any recent request (engine), and the bound on what the shared store keeps."""

from __future__ import annotations

import pytest

from milepost.engine.draft_ngram import _AT, NgramDrafter, gram_key
from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams


def req(prompt: list[int], output: list[int] = ()) -> Request:
    r = Request(rid="r", prompt_ids=list(prompt), params=SamplingParams(), on_output=lambda o: None,
                stop_ids=frozenset())
    r.output_ids.extend(output)
    return r


def test_a_sibling_of_the_same_prompt_proposes_its_continuation() -> None:
    d = NgramDrafter(2, 4, "prompt")
    first = req([1, 2, 3], [50, 51, 52, 53, 54])
    assert d.propose(first, 2) == []  # its own text has no repeat of its tail
    sibling = req([1, 2, 3], [50, 51])
    assert d.propose(sibling, 3) == [52, 53, 54]  # what the first sample wrote after "50 51"
    other = req([7, 2, 3], [50, 51])  # another prompt: not a sibling
    assert d.propose(other, 3) == []
    assert NgramDrafter(2, 4, "request").propose(req([1, 2, 3], [50, 51]), 3) == []


def test_a_finished_sibling_still_proposes_and_engine_scope_crosses_prompts() -> None:
    d = NgramDrafter(2, 4, "prompt")
    done = req([1, 2, 3], [60, 61, 62, 63])
    d.propose(done, 1)
    del done  # finished and gone from the engine: its text stays in the store
    assert d.propose(req([1, 2, 3], [60, 61]), 2) == [62, 63]
    e = NgramDrafter(2, 4, "engine")
    e.propose(req([1, 2, 3], [60, 61, 62, 63]), 1)
    assert e.propose(req([9, 9], [60, 61]), 2) == [62, 63]
    # A proposal from another text stops where that text ends (no loop through a foreign text).
    assert e.propose(req([8, 8], [62]), 5) == []
    assert e.propose(req([8, 8, 61, 62]), 5) == [63]


def test_a_finished_request_indexes_its_last_tokens_for_its_siblings() -> None:
    d = NgramDrafter(2, 4, "prompt")
    first = req([1, 2, 3], [50, 51])
    d.propose(first, 1)  # indexed up to here
    first.output_ids.extend([52, 53, 54])  # decoded on without proposing (a rest), then finished
    assert d.propose(req([1, 2, 3], [51, 52]), 2) == []  # not in the index yet
    d.record_finished(first)
    assert d.propose(req([1, 2, 3], [51, 52]), 2) == [53, 54]
    d.record_finished(req([1, 2, 3], [70, 71, 72]))  # one that never proposed: indexed whole
    assert d.propose(req([1, 2, 3], [70, 71]), 1) == [72]
    own = NgramDrafter(2, 4, "request")  # nothing outlives a request there
    own.record_finished(first)
    assert own.indexed_tokens == 0 and own.propose(req([1, 2, 3], [51, 52]), 2) == []


def test_siblings_leave_the_prompt_to_the_first_one_that_indexed_it() -> None:
    """A GRPO group's samples share one prompt: the first indexes it, the others only their
    outputs (their proposals from the prompt come through the first one's entries)."""
    d = NgramDrafter(2, 4, "prompt")
    prompt = [5, 6, 7, 8, 5, 6, 9, 10]
    a = req(prompt, [11])
    d.propose(a, 1)
    assert d.indexed_tokens == 9
    b = req(prompt, [5, 6])
    assert d.propose(b, 2) == [9, 10]  # "5 6" continued as the prompt goes on (a's entries)
    assert d.indexed_tokens == 9 + 2, "b indexed the prompt again"
    small = NgramDrafter(2, 4, "prompt", capacity=9)
    small.propose(req(prompt, [11]), 1)
    small.propose(req([1, 2, 3], [4]), 1)  # pushes the first sample out of the store
    c = req(prompt, [5, 6])
    assert small.propose(c, 2) == [9, 10], "with the first one dropped, c indexes the prompt itself"
    # A sibling that left the prompt to one dropped later indexes it then.
    d2 = NgramDrafter(2, 4, "prompt", capacity=15)
    d2.propose(req(prompt, [11]), 1)
    e = req(prompt, [5, 6])
    d2.propose(e, 1)
    assert e in d2._seqs and d2._seqs[e].skip == len(prompt)
    d2.propose(req([1, 2, 3, 4], [0]), 1)  # 9 + 2 + 5 > 15: the first sample goes
    assert d2._seqs[e].live and d2._seqs[e].skip == 0 and d2.indexed_tokens == 15
    assert d2.propose(e, 1) == [9], "the prompt's n-grams are e's own now"
    # One with no output yet has nothing else in the prompt's table: it stays in the store.
    d3 = NgramDrafter(2, 4, "prompt", capacity=13)
    d3.propose(req(prompt, [11]), 1)
    f = req(prompt)
    d3.propose(f, 1)
    d3.propose(req([1, 2, 3, 4], [0]), 1)  # 9 + 5 > 13: the first sample goes
    assert d3._seqs[f].live and d3._tables.get(tuple(prompt)) is d3._seqs[f].table


def test_the_store_drops_the_oldest_sequences_past_its_capacity() -> None:
    d = NgramDrafter(2, 2, "engine", capacity=10)
    old = req([1, 2, 3, 4, 5, 6])
    d.propose(old, 1)
    assert d.indexed_tokens == 6
    assert d.propose(req([0, 0, 4, 5]), 1) == [6]
    new = req([20, 21, 22, 23, 24])  # 6 + 4 + 5 > 10: the oldest (and then the next) go
    d.propose(new, 1)
    assert d.indexed_tokens <= 10
    assert d.propose(req([1, 2]), 1) == []  # "1 2" went with the oldest
    assert d.propose(req([21, 22]), 1) == [23]
    # Every table entry points at a sequence still kept.
    kept = {rec.num for rec in d._ages}
    assert all(at // _AT in kept for t in d._tables.values() for at in t.values())


def test_a_dropped_request_still_in_flight_is_indexed_again() -> None:
    d = NgramDrafter(2, 2, "engine", capacity=4)
    a = req([1, 2, 3, 1, 2])
    assert d.propose(a, 1) == [3]
    d.propose(req([30, 31, 32, 33]), 1)  # pushes a out of the store
    a.output_ids.append(3)
    assert d.propose(a, 2) == [1, 2]  # a's own text again, indexed anew


@pytest.mark.parametrize("scope, capacity, message", [
    ("all", 10, "--speculative-ngram-scope"), ("prompt", 0, "--speculative-ngram-capacity")])
def test_bad_scope_or_capacity_is_refused(scope: str, capacity: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NgramDrafter(2, 4, scope, capacity)  # type: ignore[arg-type]


def test_bench_groups_prompts_and_checks_its_scope_flags() -> None:
    from milepost.bench import workloads
    from milepost.bench.args import BenchArgs

    w = workloads.fixed(6, 5, 3, 100, seed=0, n_samples=3)
    assert w.name == "fixed-n3" and w.prompts[0] == w.prompts[2] != w.prompts[3] == w.prompts[5]
    with pytest.raises(ValueError, match="--n-samples-per-prompt"):
        BenchArgs(shape="tiny", requests=10, n_samples_per_prompt=4)
    with pytest.raises(ValueError, match="--speculative-ngram-scope"):
        BenchArgs(shape="tiny", speculative="ngram", speculative_ngram_scope="prompt,global")


@pytest.mark.parametrize("scope", ["request", "prompt", "engine"])
def test_the_index_leaves_nothing_for_the_garbage_collector(scope: str) -> None:
    # Tuples in the index (n-grams as keys, (sequence, position) as values) left ~8 tracked
    # objects a token behind them, and full collections grew frequent and long (up to 80 ms each
    # in a 3 s multi-turn run on an H100). Ints are not tracked, nor is a dict holding only ints.
    import gc

    d = NgramDrafter(2, 8, scope)
    r = req(list(range(50)))
    d.propose(r, 4)
    gc.collect()
    before = len(gc.get_objects())
    r.output_ids.extend((i * 7919) % 100_003 + 50 for i in range(5000))  # all distinct
    r.output_ids.extend(range(40, 45))  # then the prompt's 40 .. 44 again: 45 .. 48 follow
    assert d.propose(r, 4) == [45, 46, 47, 48]
    table = d._seqs[r].table
    assert len(table) > 7 * 5000 and not gc.is_tracked(table)
    assert len(gc.get_objects()) - before < 50


def test_gram_keys_are_distinct_across_lengths_and_extend_by_one_digit() -> None:
    grams = [[0], [0, 0], [1], [0, 1], [1, 0], [5, 0, 0], [0, 5, 0]]
    assert len({gram_key(g) for g in grams}) == len(grams)
    assert gram_key([7, 8, 9]) == gram_key([8, 9]) | (7 + 1) << 64


def test_request_scope_carries_a_conversation_into_its_next_turn() -> None:
    # The next turn's prompt is the last turn's text and a new message: its request takes over
    # the finished turn's index and indexes only the new tokens, not the history again.
    d = NgramDrafter(2, 4, "request", capacity=1000)
    history = list(range(100, 140))
    first = req(history, [50, 51, 52, 53, 54])
    assert d.propose(first, 2) == []
    table = d._seqs[first].table
    d.record_finished(first)
    second = req(history + [50, 51, 52, 53, 54] + [7, 8, 50, 51])  # ... "50 51" again
    assert d.propose(second, 3) == [52, 53, 54]  # the first turn's continuation
    assert d._seqs[second].table is table and d._turns == {} and d.indexed_tokens == 0
    other = req(list(range(300, 340)))  # another conversation starts its own table
    d.propose(other, 1)
    assert d._seqs[other].table is not table


def test_kept_turns_are_bounded_by_the_capacity() -> None:
    d = NgramDrafter(2, 4, "request", capacity=100)
    for start in (0, 1000, 2000):
        r = req(list(range(start, start + 40)), [start + 999])
        d.propose(r, 1)
        d.record_finished(r)
    assert d.indexed_tokens <= 100 and len(d._ages) == 2  # the oldest (41 tokens) went
    assert d._continued(list(range(0, 41)) + [5]) is None
    assert d._continued(list(range(2000, 2040)) + [2999, 5]) is not None


def test_a_turn_is_kept_once() -> None:
    d = NgramDrafter(2, 4, "request", capacity=1000)
    r = req(list(range(40)), [1, 2, 3])
    d.propose(r, 1)
    d.record_finished(r)
    d.record_finished(r)  # an engine finishes a request once; twice must not keep it twice
    assert d.indexed_tokens == 43 and sum(len(v) for v in d._turns.values()) == 1


@pytest.mark.parametrize("scope", ["prompt", "engine"])
def test_shared_scopes_carry_a_conversation_into_its_next_turn(scope: str) -> None:
    # The next turn joins the finished turn's table and indexes only its new tokens; the
    # history's n-grams stay the finished turn's (whose text is the prompt's beginning).
    d = NgramDrafter(2, 4, scope, capacity=1000)
    history = list(range(100, 140))
    first = req(history, [50, 51, 52, 53, 54])
    d.propose(first, 2)
    d.record_finished(first)
    before = d.indexed_tokens
    second = req(history + [50, 51, 52, 53, 54] + [7, 8, 50, 51])  # ... "50 51" again
    assert d.propose(second, 3) == [52, 53, 54]
    rec = d._seqs[second]
    assert rec.table is d._seqs[first].table and rec.skip == 45 and rec.src == d._seqs[first].num
    assert d.indexed_tokens == before + 4, "the history was indexed again"
    # The history read as its own text: a loop through the prompt's end goes on repeating.
    looping = req(history + [50, 51, 52, 53, 54, 50, 51, 52, 53, 54, 50])
    assert d.propose(looping, 6) == [51, 52, 53, 54, 50, 51]
    # Another conversation with the same beginning but another history is no continuation.
    branch = req(history[:20] + [9] * 30)
    d.propose(branch, 1)
    assert d._seqs[branch].src == 0


def test_a_dropped_turn_leaves_its_history_to_the_turn_that_continued_it() -> None:
    d = NgramDrafter(2, 4, "engine", capacity=70)
    history = list(range(100, 140))
    first = req(history, [50, 51])
    d.propose(first, 1)
    d.record_finished(first)
    d.propose(req(list(range(300, 310))), 1)  # another text, younger than the first turn
    second = req(history + [50, 51, 7, 8])
    d.propose(second, 1)
    rec = d._seqs[second]
    assert rec.skip == 42 and d.indexed_tokens == 42 + 10 + 2
    # 54 + 20 > 70: the first turn goes (its history then counts as the second's: still over)
    # and then the next oldest; the second turn stays, its history indexed as its own.
    d.propose(req(list(range(500, 520))), 1)
    assert not d._seqs[first].live and d._turns == {}
    assert rec.live and rec.skip == 0 and rec.src == 0 and d.indexed_tokens == 44 + 20
    second.output_ids.extend([110, 111])
    assert d.propose(second, 3) == [112, 113, 114], "the history's n-grams are second's own now"


def test_a_prompt_table_that_empties_leaves_under_every_key() -> None:
    d = NgramDrafter(2, 4, "prompt", capacity=50)
    history = list(range(100, 130))
    first = req(history, [50])
    d.propose(first, 1)
    d.record_finished(first)
    second = req(history + [50, 7])
    d.propose(second, 1)
    d.record_finished(second)
    table = d._seqs[first].table
    assert d._tables[tuple(history)] is table and d._tables[tuple(history + [50, 7])] is table
    d.propose(req(list(range(500, 549))), 1)  # both turns go
    assert all(t is not table for t in d._tables.values()) and d._turns == {}


def test_catch_up_indexes_what_is_on_the_host_and_leaves_a_pending_slot() -> None:
    # A resting step's forward is launched with the previous step's token still on the device
    # (its slot -1): the index takes everything before it, and the slot once it is filled.
    d = NgramDrafter(2, 4, "request")
    r = req([1, 2, 3, 4], [5, 6, -1])
    d.catch_up([r])
    assert d._seqs[r].seq == [1, 2, 3, 4, 5, 6]
    r.output_ids[-1] = 1
    r.output_ids.append(2)
    d.catch_up([r])
    assert d._seqs[r].seq == [1, 2, 3, 4, 5, 6, 1, 2]
    assert d.propose(r, 2) == [3, 4]  # from the index alone: nothing left to add


def test_catch_up_stops_at_its_budget_and_goes_on_where_it_stopped() -> None:
    d = NgramDrafter(2, 4, "request")
    reqs = [req(list(range(10 * i, 10 * i + 8))) for i in range(5)]
    d.catch_up(reqs, budget_s=0.0)  # past the deadline after the first request
    assert [r in d._seqs for r in reqs] == [True, False, False, False, False]
    d.catch_up(reqs, budget_s=0.0)
    assert [r in d._seqs for r in reqs] == [True, True, False, False, False]
    d.catch_up(reqs)  # the rest, from the third on
    assert all(r in d._seqs for r in reqs) and d._catch_up_from == 0
