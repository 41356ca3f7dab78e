"""Reward functions: answer extraction and normalization, loading by name or path, error reporting."""

from __future__ import annotations

import asyncio
import math

import pytest

from milepost.rollout.rewards import (
    exact_match,
    extract_answer,
    last_boxed,
    load_group_reward_fn,
    load_reward_fn,
    math_reward,
    normalize_answer,
    score_group,
)
from milepost.types import Sample


def sample(response: str, label: object = None, index: int = 0) -> Sample:
    return Sample(group_index=0, index=index, tokens=[1, 2], response_length=1,
                  response=response, label=label)


@pytest.mark.parametrize("text, boxed", [
    (r"so \boxed{42}.", "42"),
    (r"\boxed{1} then \boxed{\frac{a^{2}}{b_{1}}}", r"\frac{a^{2}}{b_{1}}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\fbox{7}", "7"),
    (r"\boxed{3} and an unclosed \boxed{4", "3"),
    ("no box here", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("response, answer", [
    (r"The sum is \boxed{\dfrac{3}{4}}", r"\dfrac{3}{4}"),
    ("So the answer is 12.", "12"),
    ("Answer: -5", "-5"),
    ("The answer is 5 apples.", "5"),
    ("First 3, then 4, finally -17.5 remains", "-17.5"),
    ("It costs 1,250 dollars", "1,250"),
    ("<think>it is 41</think> The answer is 42", "42"),
    ("<think>maybe 41 or 42, I need more", None),  # reasoning never finished: no answer
    ("I don't know", None),
    ("", None),
])
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize("a, b", [
    ("3.0", "3"), ("3.50", "7/2"), ("0.5", r"\frac{1}{2}"), (r"\dfrac12", "1/2"),
    ("6/4", "3/2"), ("-2/4", r"-\frac{1}{2}"), ("$-12$", "-12"), ("1,000", "1000"),
    (r"x = 5", "5"), (r"\text{(A)}", "(A)"), ("50\\%", "50"), (r"\left( 1, 2 \right)", "(1,2)"),
])
def test_normalize_equal(a, b):
    assert normalize_answer(a) == normalize_answer(b)


@pytest.mark.parametrize("a, b", [("3", "-3"), ("1/2", "1/3"), ("1,2", "12"), ("3.01", "3"),
                                  (r"\sqrt{2}", "2")])
def test_normalize_different(a, b):
    assert normalize_answer(a) != normalize_answer(b)


@pytest.mark.parametrize("response, label, reward", [
    (r"Thus \boxed{\frac{6}{8}}.", "3/4", 1.0),
    (r"Thus \boxed{\frac{6}{8}}.", "0.75", 1.0),
    ("the answer is 3.0", 3, 1.0),
    ("the answer is 3.0", 3.0, 1.0),
    ("the answer is -4", "4", 0.0),
    ("result: 10, final 12", "12", 1.0),
    (r"we get \boxed{12}", r"\boxed{12}", 1.0),  # a boxed label is unboxed
    ("nothing to see", "1", 0.0),
    ("the answer is 7", None, 0.0),
])
def test_math_reward(response, label, reward):
    assert math_reward(sample(response, label)) == reward


def test_exact_match():
    assert exact_match(sample("  Paris. ", "paris")) == 1.0
    assert exact_match(sample("<think>hmm</think>\nNew  York", "new york")) == 1.0
    assert exact_match(sample("Paris, France", "Paris")) == 0.0
    assert exact_match(sample("<think>Paris", "Paris")) == 0.0


async def _async_reward(s: Sample) -> float:
    await asyncio.sleep(0)
    return 0.25


def _ranks(group: list[Sample]) -> list[float]:
    return [float(i) for i in range(len(group))]


def _raises(s: Sample) -> float:
    raise RuntimeError("judge unreachable")


def test_load_by_name_and_import_path():
    assert load_reward_fn("math") is math_reward and load_reward_fn("exact_match") is exact_match
    assert load_reward_fn(f"{__name__}:_async_reward") is _async_reward
    assert load_group_reward_fn(f"{__name__}:_ranks") is _ranks
    with pytest.raises(ValueError, match=r"reward_fn: unknown reward function 'maths'.*builtins"):
        load_reward_fn("maths")
    with pytest.raises(ValueError, match=r"my_setting: cannot import 'no_such_mod:f'"):
        load_reward_fn("no_such_mod:f", setting="my_setting")
    with pytest.raises(ValueError, match="not callable"):
        load_reward_fn("math:pi")
    with pytest.raises(ValueError, match="give an import path"):
        load_group_reward_fn("rank")


def test_score_group_sync_async_and_group_fn():
    group = [sample("the answer is 1", "1", 0), sample("the answer is 2", "1", 1)]
    assert asyncio.run(score_group(group, math_reward)) is None
    assert [s.reward for s in group] == [1.0, 0.0]
    assert asyncio.run(score_group(group, _async_reward)) is None
    assert [s.reward for s in group] == [0.25, 0.25]

    seen = []

    def combine(g: list[Sample]) -> list[float]:
        seen.extend(s.reward for s in g)  # sees the per-sample rewards
        return [10.0, 20.0]

    assert asyncio.run(score_group(group, math_reward, combine)) is None
    assert seen == [1.0, 0.0] and [s.reward for s in group] == [10.0, 20.0]
    assert asyncio.run(score_group(group, None, _ranks)) is None
    assert [s.reward for s in group] == [0.0, 1.0]


@pytest.mark.parametrize("reward_fn, group_fn, match", [
    (_raises, None, "RuntimeError: judge unreachable"),
    (lambda s: "1", None, "returned '1'; a reward must be a finite number"),
    (lambda s: math.nan, None, "a reward must be a finite number"),
    (None, lambda g: [1.0], "expected a list of 2 rewards"),
    (None, lambda g: 1 / 0, "ZeroDivisionError"),
])
def test_score_group_errors_are_reported_not_zeroed(reward_fn, group_fn, match):
    group = [sample("the answer is 1", "1", 0), sample("x", "1", 1)]
    error = asyncio.run(score_group(group, reward_fn, group_fn))
    assert error is not None and match in error
    assert all(s.reward is None for s in group)  # no made-up reward on any sample
    assert any(match in s.metadata.get("reward_error", "") for s in group)
