"""The demo task: deterministic data, a lazy tutor that estimates as specified, an exact verifier."""

from __future__ import annotations

import pytest

from milepost.demo.task import (
    ESTIMATE_MARK,
    OPERANDS,
    Problem,
    drill_records,
    parse_answer,
    problems,
    prompt_records,
    read_jsonl,
    reward,
    score,
    tutor_records,
    write_datasets,
)
from milepost.types import Sample, Status


def _sample(response: str, label: object = "68", status: Status = Status.COMPLETED) -> Sample:
    return Sample(group_index=3, index=1, tokens=[1, 2, 3], response_length=1, response=response,
                  label=label, status=status)


def _operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.removesuffix("=").split("+")
    return int(a), int(b)


def test_prompt_records_are_deterministic_and_labelled_with_the_sum():
    a, b = prompt_records(300, seed=5), prompt_records(300, seed=5)
    assert a == b
    assert a != prompt_records(300, seed=6)
    lo, hi = OPERANDS
    for r in a:
        x, y = _operands(r["prompt"])
        assert r["prompt"] == f"{x}+{y}="
        assert lo <= x <= hi and lo <= y <= hi
        assert r["label"] == str(x + y)
    # A prefix of a longer stream: the count does not change earlier records.
    assert prompt_records(50, seed=5) == a[:50]


def test_problems_cover_the_operand_range_and_refuse_bad_ranges():
    seen = {p.a for p, _ in zip(problems(0), range(3000))}
    assert seen == set(range(OPERANDS[0], OPERANDS[1] + 1))
    with pytest.raises(ValueError, match="operands"):
        next(problems(0, (5, 2)))


def test_estimate_is_the_sum_rounded_half_up_to_tens():
    assert Problem(23, 45).estimate == ESTIMATE_MARK + "70"
    assert Problem(21, 42).estimate == "~60"
    assert Problem(20, 45).estimate == "~70"  # 65 rounds up
    assert Problem(99, 99).estimate == "~200"


def test_drills_are_exact():
    for r in drill_records(200, seed=3):
        x, y = _operands(r["prompt"])
        assert r["response"] == r["label"] == str(x + y)


def test_tutor_records_are_deterministic_and_estimate_as_specified():
    recs = tutor_records(4000, seed=1, teacher_accuracy=0.4)
    assert recs == tutor_records(4000, seed=1, teacher_accuracy=0.4)
    exact = 0
    for r in recs:
        p = Problem(*_operands(r["prompt"]))
        assert r["label"] == p.answer
        if r["response"] == p.answer:
            exact += 1
        else:
            assert r["response"] == p.estimate
    assert 0.37 < exact / len(recs) < 0.43


@pytest.mark.parametrize("accuracy, expected", [(1.0, 1.0), (0.0, 0.0)])
def test_teacher_accuracy_extremes(accuracy, expected):
    recs = tutor_records(300, seed=2, teacher_accuracy=accuracy)
    assert sum(r["response"] == r["label"] for r in recs) / len(recs) == expected


def test_teacher_accuracy_out_of_range_is_refused():
    with pytest.raises(ValueError, match="teacher_accuracy"):
        tutor_records(10, seed=0, teacher_accuracy=1.5)


def test_write_datasets_round_trip(tmp_path):
    paths = write_datasets(tmp_path, n_prompts=30, n_drills=40, n_tutor=50, seed=9)
    assert read_jsonl(paths["rl_prompts"]) == prompt_records(30, seed=9)
    assert read_jsonl(paths["drills"]) == drill_records(40, seed=10)
    assert read_jsonl(paths["tutor"]) == tutor_records(50, seed=11)
    # The three sets come from different problem streams.
    firsts = [read_jsonl(p)[0]["prompt"] for p in paths.values()]
    assert len(set(firsts)) == 3


@pytest.mark.parametrize(
    "response, value",
    [
        ("68", 1.0),
        (" 68", 1.0),
        ("68\n", 1.0),
        ("\t68 ", 1.0),
        ("68<|im_end|>", 1.0),  # an engine that keeps the end-of-turn marker
        ("69", 0.0),
        ("6", 0.0),
        ("686", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("<|im_end|>", 0.0),
        ("~68", 0.0),  # an estimate never scores, even when it is the sum
        ("~70", 0.0),
        ("68 68", 0.0),
        ("6 8", 0.0),
        ("68.", 0.0),
        ("68.0", 0.0),
        ("068", 0.0),  # not plain decimal
        ("+68", 0.0),
        ("-68", 0.0),
        ("The answer is 68", 0.0),
        ("sixty-eight", 0.0),
        ("٦٨", 0.0),  # non-ASCII digits
        ("68<|im_end|><|im_end|>", 0.0),
    ],
)
def test_reward_hand_cases(response, value):
    assert reward(_sample(response)) == value


def test_reward_label_int_or_str_and_zero():
    assert reward(_sample("105", label=105)) == 1.0
    assert reward(_sample("0", label="0")) == 1.0
    assert reward(_sample("00", label="0")) == 0.0
    # A truncated response is judged by its text like any other.
    assert reward(_sample("686868", status=Status.TRUNCATED)) == 0.0


def test_reward_refuses_missing_or_non_integer_label():
    with pytest.raises(ValueError, match="no label"):
        reward(_sample("68", label=None))
    with pytest.raises(ValueError, match="label must be an integer"):
        score("68", "sixty-eight")


def test_parse_answer():
    assert parse_answer(" 123\n") == 123
    assert parse_answer("12a") is None
    assert parse_answer("1" * 13) is None  # absurdly long numbers are not answers
