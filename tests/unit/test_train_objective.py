"""Advantages, losses, LR schedule, data-parallel split and micro-batch planning against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from milepost.train.advantages import AdvantageSettings, get_estimator, grpo, register
from milepost.train.batch import TrainBatch, split_for_rank
from milepost.train.logprobs import plan_micro_batches
from milepost.train.losses import LossBatch, LossSettings, kl_estimate, policy_loss, ppo_clip
from milepost.train.optim import lr_at
from milepost.train.settings import TrainerSettings
from milepost.types import Sample


def sample(group: int, index: int, reward: float | None, resp: int = 3) -> Sample:
    return Sample(group_index=group, index=index, tokens=list(range(5, 10 + resp)), response_length=resp, reward=reward)


# --- advantages ------------------------------------------------------------------------------------


def test_grpo_matches_hand_values_with_single_sample_group() -> None:
    samples = [sample(0, 0, 1.0), sample(0, 1, 0.0, resp=2), sample(0, 2, 0.5), sample(7, 0, 3.0)]
    adv = grpo(samples, AdvantageSettings(normalize_std=True, eps=1e-6))
    std = math.sqrt(((0.5) ** 2 + 0.5**2 + 0) / 2)  # Bessel-corrected std of [1, 0, 0.5]
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.0, 0.0]  # group of one: advantage 0
    for a, e, s in zip(adv, expected, samples):
        assert a.shape == (s.response_length,) and a.dtype == torch.float32
        torch.testing.assert_close(a, torch.full_like(a, e), rtol=0, atol=1e-6)


def test_grpo_without_std_and_uniform_groups() -> None:
    samples = [sample(1, 0, 2.0), sample(1, 1, 4.0), sample(2, 0, 1.0), sample(2, 1, 1.0)]
    adv = grpo(samples, AdvantageSettings(normalize_std=False))
    assert [float(a[0]) for a in adv] == [-1.0, 1.0, 0.0, 0.0]
    adv = grpo(samples, AdvantageSettings(normalize_std=True))
    assert float(adv[2][0]) == 0.0 and float(adv[3][0]) == 0.0  # std 0 -> 0, never nan


def test_estimator_lookup_by_name_and_path_and_errors() -> None:
    assert get_estimator("grpo") is grpo
    assert get_estimator("milepost.train.advantages:grpo") is grpo
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        get_estimator("nope")
    with pytest.raises(ValueError, match="could not be imported"):
        get_estimator("milepost.train.advantages:missing")
    with pytest.raises(ValueError, match="already registered"):
        register("grpo")(lambda s, c, i: [])
    with pytest.raises(ValueError, match="no reward"):
        grpo([sample(0, 0, None)], AdvantageSettings())


# --- losses ----------------------------------------------------------------------------------------


def test_ppo_clip_and_kl_against_float64_hand_values() -> None:
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1], dtype=torch.float64)
    old = torch.tensor([-1.0, -1.0, -1.5, -0.1], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0], dtype=torch.float64)
    loss, clipped, approx_kl = ppo_clip(logp, old, adv, 0.2, 0.3)
    r = [1.0, math.exp(0.5), math.exp(-0.5), 1.0]
    expected = [
        -1.0,  # ratio 1: both terms -1
        max(-r[1], -1.3),  # ratio 1.65 > 1.3: clipped term -1.3 is larger
        max(r[2], 0.8),  # A<0, ratio 0.61 < 0.8: clipped 0.8 larger
        2.0,
    ]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64))
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0]
    torch.testing.assert_close(approx_kl, old - logp)

    ref = torch.tensor([-1.2, -0.5, -1.0, 0.0], dtype=torch.float64) - 0.3
    d = (logp - ref).tolist()
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor(d, dtype=torch.float64))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([x * x / 2 for x in d], dtype=torch.float64))
    k3 = [math.exp(-x) - 1 + x for x in d]
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor(k3, dtype=torch.float64))
    with pytest.raises(ValueError, match="kl_loss_type"):
        kl_estimate(logp, ref, "k4")


def test_policy_loss_masks_tokens_and_divides_by_global_count() -> None:
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1], dtype=torch.float64, requires_grad=True)
    entropy = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.0, -1.0, -1.5, -0.1], dtype=torch.float64)
    ref = old - 0.25
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    s = LossSettings(eps_clip=0.2, eps_clip_high=0.3, kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1)
    batch = LossBatch(logp, entropy, mask, torch.tensor([0, 0, 1, 1]), 2, token_denom=10.0, seq_denom=2.0,
                      advantages=adv, old_logp=old, ref_logp=ref)
    loss, sums = policy_loss(batch, s)
    pg = [-1.0, -1.3, None, 2.0]
    kl = (logp.detach() - ref).tolist()
    want_pg = pg[0] + pg[1] + pg[3]
    want_kl = kl[0] + kl[1] + kl[3]
    want = (want_pg - 0.1 * (1 + 2 + 4) + 0.5 * want_kl) / 10.0
    assert abs(float(loss.detach()) - want) < 1e-12
    assert abs(float(sums["pg_loss"]) - want_pg) < 1e-12
    assert float(sums["pg_clipfrac"]) == 1.0 and float(sums["entropy"]) == 7.0
    assert abs(float(sums["kl"]) - want_kl) < 1e-12
    loss.backward()
    assert logp.grad[2] == 0 and entropy.grad[2] == 0  # the masked token gets no gradient
    assert logp.grad[1] == 0.5 / 10.0  # clipped token: only the KL term's gradient remains
    torch.testing.assert_close(entropy.grad, torch.tensor([-0.01, -0.01, 0.0, -0.01], dtype=torch.float64))


# --- schedule, settings ----------------------------------------------------------------------------


def test_lr_schedule_warmup_then_cosine_to_min() -> None:
    s = TrainerSettings(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_style="cosine", num_steps_total=6)
    got = [lr_at(i, s) for i in range(8)]
    assert got[:2] == [0.5, 1.0]
    assert got[2] == 1.0 and abs(got[4] - 0.55) < 1e-12 and got[6] == got[7] == pytest.approx(0.1)
    c = TrainerSettings(lr=2.0, lr_warmup_iters=0)
    assert [lr_at(i, c) for i in (0, 100)] == [2.0, 2.0]


def test_settings_refuse_bad_combinations() -> None:
    with pytest.raises(ValueError, match="needs use_kl_loss=True"):
        TrainerSettings(kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="num_steps_total"):
        TrainerSettings(lr_decay_style="cosine")
    with pytest.raises(ValueError, match="kl_loss_type"):
        TrainerSettings(kl_loss_type="k7")  # type: ignore[arg-type]
    assert TrainerSettings(eps_clip=0.2).clip_high == 0.2
    assert TrainerSettings(eps_clip=0.2, eps_clip_high=0.28).clip_high == 0.28


# --- batching --------------------------------------------------------------------------------------


def test_split_for_rank_keeps_steps_and_balances_tokens() -> None:
    lengths = [9, 8, 7, 1, 1, 1, 5, 5, 2, 9, 9, 2]  # two steps of 6; a contiguous split gives 17/8/2
    parts = [split_for_rank(lengths, r, 3, 6) for r in range(3)]
    assert sorted(i for p in parts for i in p) == list(range(12))
    for p in parts:
        assert len(p) == 4 and all(i < 6 for i in p[:2]) and all(i >= 6 for i in p[2:])
    step0 = [sum(lengths[i] for i in p[:2]) for p in parts]
    assert sorted(step0) == [8, 9, 10]  # longest first to the lightest rank: 9+1, 8+1, 7+1
    with pytest.raises(ValueError, match="multiple of the world size"):
        split_for_rank(lengths, 0, 5, 6)
    with pytest.raises(ValueError, match="whole number of optimizer steps"):
        split_for_rank(lengths[:5], 0, 3, 6)


def test_plan_micro_batches_budget_and_alignment() -> None:
    # longest first, first fit: the 3 fills the gap beside a 5 (three passes, not four)
    assert plan_micro_batches([5, 5, 5, 20, 3], 10) == [[3], [0, 1], [2, 4]]
    assert plan_micro_batches([2, 7, 3, 6], 10) == [[1, 2], [0, 3]]
    assert plan_micro_batches([4, 4, 4], 100, count=3) == [[0], [1], [2]]
    assert plan_micro_batches([4], 100, count=3) == [[0], [], []]
    assert plan_micro_batches([], 100, count=2) == [[], []]
    with pytest.raises(ValueError, match="cannot fit"):
        plan_micro_batches([5, 5, 5], 5, count=2)


def test_train_batch_validates_and_builds_from_samples() -> None:
    samples = [sample(0, 0, 1.0), sample(0, 1, 0.0)]
    samples[0].loss_mask = [1, 0, 1]
    samples[0].rollout_logprobs = [-0.1, -0.2, -0.3]
    b = TrainBatch.from_samples(samples, grpo(samples, AdvantageSettings()))
    assert b.loss_masks[0].tolist() == [1.0, 0.0, 1.0] and b.loss_masks[1].tolist() == [1.0] * 3
    assert b.rollout_logprobs is None  # only one sample has them
    assert b.select([1]).tokens[0].tolist() == samples[1].tokens
    with pytest.raises(ValueError, match="response_length"):
        TrainBatch([torch.arange(3)], [3], [torch.ones(3)], [torch.ones(3)])
    with pytest.raises(ValueError, match=r"advantages\[0\] has shape"):
        TrainBatch([torch.arange(4)], [2], [torch.ones(2)], [torch.ones(3)])
