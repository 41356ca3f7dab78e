"""The version proof of an evaluation score (report section 2.2.4): which weights it measured."""

from __future__ import annotations

import pytest

from milepost.eval.versions import check_versions
from milepost.types import Sample


def sample(versions: list[str]) -> Sample:
    return Sample(group_index=0, index=0, tokens=[1] * (2 + len(versions)),
                  response_length=len(versions), weight_versions=versions)


def test_one_version_everywhere_is_accepted() -> None:
    check = check_versions([sample(["4", "4"]), sample(["4"])], "4")
    assert check.reject_reason is None
    assert check.mean_version == 4.0 and check.mixed_fraction == 0.0


def test_a_request_served_by_two_versions_rejects_the_score() -> None:
    check = check_versions([sample(["3", "4"]), sample(["4"]), sample(["4"]), sample(["4"])], "4")
    assert check.mixed_fraction == pytest.approx(0.25)
    assert check.mean_version == pytest.approx((3.5 + 4 + 4 + 4) / 4)
    assert "mixed weight versions ['3', '4']" in check.reject_reason


def test_an_engine_holding_older_weights_rejects_the_score() -> None:
    # No request is mixed, but one engine still served version 3: the mean is not the step's.
    check = check_versions([sample(["3", "3"]), sample(["4", "4"])], "4")
    assert check.mixed_fraction == 0.0 and check.mean_version == 3.5
    assert "not the expected '4'" in check.reject_reason


def test_non_numeric_versions_have_no_mean_but_are_still_checked() -> None:
    assert check_versions([sample(["default"])], "default").reject_reason is None
    check = check_versions([sample(["default"])], "1")
    assert check.mean_version is None and "not the expected '1'" in check.reject_reason


def test_samples_without_tokens_carry_no_version() -> None:
    check = check_versions([sample([])], "1")
    assert "no response tokens" in check.reject_reason
    assert check_versions([sample([]), sample(["1"])], "1").reject_reason is None
