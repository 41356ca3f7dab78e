"""On-policy distillation signal: the advantage adjustment against hand values (report 5.2)."""

from __future__ import annotations

import math

import pytest
import torch

from milepost.train.advantages import AdvantageInputs, AdvantageSettings, estimate
from milepost.train.distill import (
    TOPK_KEY,
    DistillError,
    apply_opd,
    distill_stats,
    sample_signal,
    topk_reverse_kl,
)
from milepost.types import Sample


def _sample(g: int, i: int, student: list[float], teacher: list[float] | None, reward: float,
            mask: list[int] | None = None) -> Sample:
    n = len(student)
    return Sample(group_index=g, index=i, tokens=[1] * 3 + [5] * n, response_length=n,
                  rollout_logprobs=student, teacher_logprobs=teacher, reward=reward,
                  loss_mask=mask or [1] * n)


def test_one_sample_signal_is_student_minus_teacher() -> None:
    s = _sample(0, 0, [-0.5, -2.0, -0.1], [-1.0, -0.5, -0.1], 1.0)
    assert sample_signal(s).tolist() == pytest.approx([0.5, -1.5, 0.0])


def test_grpo_then_opd_hand_values_with_masks_and_a_group_of_one() -> None:
    # group 0: rewards 1, 0 -> GRPO advantages +-0.5/(std+eps), std = sqrt(0.5) (Bessel)
    a = _sample(0, 0, [-0.5, -2.0], [-1.0, -0.5], 1.0)
    b = _sample(0, 1, [-0.2, -0.3, -0.4], [-0.2, -1.3, -0.1], 0.0, mask=[1, 0, 1])
    c = _sample(1, 0, [-3.0], [-1.0], 1.0)  # a group of one: GRPO gives 0, the teacher still teaches
    samples = [a, b, c]
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    adv = estimate("grpo", samples, AdvantageSettings(), AdvantageInputs(loss_masks=masks)).advantages
    g = 0.5 / (math.sqrt(0.5) + 1e-6)  # centered reward 0.5 over the group std
    out = apply_opd(adv, [sample_signal(s) for s in samples], masks, coef=0.5)
    assert out[0].tolist() == pytest.approx([g - 0.5 * 0.5, g - 0.5 * -1.5], abs=1e-6)
    # the masked token keeps the estimator's advantage; the others move by -0.5 * (s - t)
    assert out[1].tolist() == pytest.approx([-g, -g, -g - 0.5 * -0.3], abs=1e-6)
    assert out[2].tolist() == pytest.approx([0.0 - 0.5 * -2.0], abs=1e-6)
    stats = distill_stats(samples, [sample_signal(s) for s in samples], masks)
    kl = [0.5, -1.5, 0.0, -0.3, -2.0]
    assert stats.tokens == 5 and stats.reverse_kl_mean == pytest.approx(sum(kl) / 5)
    assert stats.teacher_logprob_mean == pytest.approx((-1.0 - 0.5 - 0.2 - 0.1 - 1.0) / 5)


def test_opd_composes_with_token_level_estimators() -> None:
    samples = [_sample(0, 0, [-0.5, -1.0], [-0.5, -2.0], 1.0), _sample(0, 1, [-1.0], [-0.5], 0.0)]
    masks = [torch.ones(2), torch.ones(1)]
    settings = AdvantageSettings(normalize_std=False)
    adv = estimate("reinforce_plus_plus", samples, settings, AdvantageInputs(loss_masks=masks)).advantages
    out = apply_opd(adv, [sample_signal(s) for s in samples], masks, coef=1.0)
    # raw returns: [1, 1] and [0]; minus (s - t)
    assert out[0].tolist() == pytest.approx([1.0, 0.0]) and out[1].tolist() == pytest.approx([0.5])


def test_topk_weights_sum_to_one_and_hand_value() -> None:
    s_row = [math.log(0.6), math.log(0.2)]
    t_row = [math.log(0.3), math.log(0.4)]
    est = topk_reverse_kl([s_row, [math.log(0.5)]], [t_row, [math.log(0.25)]])
    w = [0.75, 0.25]  # 0.6 and 0.2 renormalized over the set
    want0 = w[0] * (s_row[0] - t_row[0]) + w[1] * (s_row[1] - t_row[1])
    assert est.tolist() == pytest.approx([want0, math.log(2.0)])
    # equal student log-probs -> equal weights: the plain mean of the differences
    assert topk_reverse_kl([[-1.0, -1.0, -1.0]], [[-1.0, -2.0, -3.0]]).tolist() == pytest.approx([1.0])


def test_topk_data_replaces_the_one_sample_estimate() -> None:
    s = _sample(0, 0, [-0.5], None, 1.0)
    s.metadata[TOPK_KEY] = {"student": [[-0.5, -1.5]], "teacher": [[-0.5, -1.5]]}
    assert sample_signal(s).tolist() == pytest.approx([0.0])


@pytest.mark.parametrize("teacher, needle", [(None, "no teacher log-probs"), ([-1.0], "1 teacher")])
def test_missing_or_short_teacher_signal_is_refused(teacher, needle) -> None:
    with pytest.raises(DistillError, match=needle):
        sample_signal(_sample(0, 0, [-0.5, -0.5], teacher, 1.0))


def test_topk_row_mismatch_refused() -> None:
    with pytest.raises(DistillError, match="position 0"):
        topk_reverse_kl([[-1.0, -2.0]], [[-1.0]])
    with pytest.raises(DistillError, match="at least one"):
        topk_reverse_kl([[]], [[]])
