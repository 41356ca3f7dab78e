"""Reading a served teacher's scoring answer: the sampled tokens' log-probs and top-K candidate rows."""

from __future__ import annotations

import math

import pytest

from milepost.rollout.teacher import TeacherError, _sampled, _topk_rows
from milepost.types import Sample


def _sample() -> Sample:
    # prompt [1, 2], response [7, 8]
    return Sample(group_index=0, index=0, tokens=[1, 2, 7, 8], response_length=2,
                  rollout_logprobs=[-0.1, -0.2], teacher_logprobs=[-0.3, -0.4])


def test_sampled_checks_length_ids_and_finiteness() -> None:
    s = _sample()
    assert _sampled({"input_token_logprobs": [[-0.5, 7, None], [-0.6, 8, None]]}, s) == [-0.5, -0.6]
    with pytest.raises(TeacherError, match="wrong lengths"):
        _sampled({"input_token_logprobs": [[-0.5, 7, None]]}, s)
    with pytest.raises(TeacherError, match="differ from the student's response ids"):
        _sampled({"input_token_logprobs": [[-0.5, 7, None], [-0.6, 9, None]]}, s)
    for bad in (None, math.inf, "x", True):
        with pytest.raises(TeacherError, match="not a finite number"):
            _sampled({"input_token_logprobs": [[bad, 7, None], [-0.6, 8, None]]}, s)


def test_topk_rows_student_set_and_intersection_with_fallback() -> None:
    s = _sample()
    student_top = [[[-0.1, 7], [-2.0, 5]], [[-0.2, 8], [-3.0, 6]]]
    by_id = [[[-0.3, 5, None], [-1.0, 6, None], [-0.7, 7, None], [-0.9, 8, None]]] * 2
    meta = {"input_token_ids_logprobs": by_id,
            "input_top_logprobs": [[[-0.3, 5, None], [-0.7, 7, None]], [[-1.0, 6, None], [-0.5, 9, None]]]}
    rows = _topk_rows(meta, s, student_top, "student")
    assert rows == {"student": [[-0.1, -2.0], [-0.2, -3.0]], "teacher": [[-0.7, -0.3], [-0.9, -1.0]]}
    rows = _topk_rows(meta, s, student_top, "intersection")
    # position 0: {7, 5} & {5, 7} = both; position 1: {8, 6} & {6, 9} = {6}
    assert rows == {"student": [[-0.1, -2.0], [-3.0]], "teacher": [[-0.7, -0.3], [-1.0]]}
    meta["input_top_logprobs"][1] = [[-0.5, 9, None]]  # empty intersection: the sampled token alone
    rows = _topk_rows(meta, s, student_top, "intersection")
    assert rows["student"][1] == [-0.2] and rows["teacher"][1] == [-0.4]


def test_topk_rows_refuse_missing_candidates_and_short_answers() -> None:
    s = _sample()
    student_top = [[[-0.1, 7]], [[-0.2, 8]]]
    with pytest.raises(TeacherError, match="rows of token_ids_logprob"):
        _topk_rows({"input_token_ids_logprobs": [[[-0.7, 7, None]]]}, s, student_top, "student")
    with pytest.raises(TeacherError, match="no teacher log-prob for candidate ids"):
        _topk_rows({"input_token_ids_logprobs": [[[-0.7, 7, None]], [[-0.7, 7, None]]]}, s,
                   student_top, "student")
