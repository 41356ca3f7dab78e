"""Estimators, losses and ratio corrections of issue 7 against hand / float64 values on small tensors.

Cases include masked tokens, groups of size 1 and one-token responses.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from milepost.train.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    estimate,
    get_estimator,
    grpo,
)
from milepost.train.corrections import CorrectionSettings, ratio_weights
from milepost.train.losses import (
    LossBatch,
    LossSettings,
    aggregate,
    get_loss,
    kl_estimate,
    policy_loss,
    sft_loss,
    value_loss,
)
from milepost.types import Sample

F64 = torch.float64


def sample(group: int, index: int, reward: float, resp: int) -> Sample:
    return Sample(group_index=group, index=index, tokens=list(range(3, 6 + resp)), response_length=resp, reward=reward)


def whiten_by_hand(values: list[list[float]], masks: list[list[float]], eps: float = 1e-6) -> list[list[float]]:
    kept = [v for vs, ms in zip(values, masks) for v, m in zip(vs, ms) if m > 0]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((v - mean) ** 2 for v in kept) / len(kept))
    return [[(v - mean) / (std + eps) for v in vs] for vs in values]


def assert_lists_close(got: list[torch.Tensor], want: list[list[float]], atol: float = 1e-5) -> None:
    assert [tuple(g.shape) for g in got] == [(len(w),) for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), torch.tensor(w, dtype=F64), rtol=0, atol=atol)


# --- estimators ------------------------------------------------------------------------------------


def test_gspo_advantages_are_grpos() -> None:
    samples = [sample(0, 0, 1.0, 2), sample(0, 1, 0.0, 3), sample(5, 0, 1.0, 1)]
    got = estimate("gspo", samples, AdvantageSettings())
    for a, b in zip(got.advantages, grpo(samples, AdvantageSettings())):
        torch.testing.assert_close(a, b)
    assert float(got.advantages[2][0]) == 0.0  # group of one


def test_reinforce_plus_plus_discounts_kl_penalized_rewards_then_whitens() -> None:
    samples = [sample(0, 0, 1.0, 3), sample(1, 0, 0.0, 2)]
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0])]
    kl = [torch.tensor([0.5, 9.0, -0.2]), torch.tensor([0.1, 0.3])]
    s = AdvantageSettings(gamma=0.9, kl_coef=0.1)
    # rewards: -0.1 * kl on loss tokens (the masked token carries no penalty), outcome on the last token
    r0 = [-0.05, 0.0, 0.02 + 1.0]
    r1 = [-0.01, -0.03 + 0.0]
    g0 = [r0[0] + 0.9 * r0[1] + 0.81 * r0[2], r0[1] + 0.9 * r0[2], r0[2]]
    g1 = [r1[0] + 0.9 * r1[1], r1[1]]
    got = estimate("reinforce_plus_plus", samples, s, AdvantageInputs(loss_masks=masks, kl=kl))
    assert_lists_close(got.advantages, whiten_by_hand([g0, g1], [m.tolist() for m in masks]))
    raw = estimate("reinforce_plus_plus", samples, AdvantageSettings(gamma=0.9, kl_coef=0.1, normalize_std=False),
                   AdvantageInputs(loss_masks=masks, kl=kl))
    assert_lists_close(raw.advantages, [g0, g1])
    assert raw.returns is None


def test_reinforce_plus_plus_baseline_subtracts_group_mean_and_single_groups_get_zero() -> None:
    samples = [sample(0, 0, 1.0, 2), sample(0, 1, 0.0, 1), sample(0, 2, 0.5, 2), sample(3, 0, 1.0, 2)]
    got = estimate("reinforce_plus_plus_baseline", samples, AdvantageSettings(normalize_std=False))
    assert_lists_close(got.advantages, [[0.5, 0.5], [-0.5], [0.0, 0.0], [0.0, 0.0]])
    whitened = estimate("reinforce_plus_plus_baseline", samples, AdvantageSettings())
    ones = [[1.0] * s.response_length for s in samples]
    assert_lists_close(whitened.advantages, whiten_by_hand([[0.5, 0.5], [-0.5], [0.0, 0.0], [0.0, 0.0]], ones))


def test_ppo_gae_and_returns_against_hand_values() -> None:
    samples = [sample(0, 0, 1.0, 3), sample(1, 0, 0.0, 1)]
    values = [torch.tensor([0.2, 0.4, 0.6]), torch.tensor([0.3])]
    masks = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0])]
    gamma, lam = 0.9, 0.8
    v = [0.2, 0.4, 0.6]
    d = [0.0 + gamma * v[1] - v[0], 0.0 + gamma * v[2] - v[1], 1.0 - v[2]]  # V after the end = 0
    a2 = d[2]
    a1 = d[1] + gamma * lam * a2
    a0 = d[0] + gamma * lam * a1
    adv0, adv1 = [a0, a1, a2], [0.0 - 0.3]
    s = AdvantageSettings(gamma=gamma, lambd=lam)
    got = estimate("ppo", samples, s, AdvantageInputs(loss_masks=masks, values=values))
    assert_lists_close(got.returns, [[a + x for a, x in zip(adv0, v)], [adv1[0] + 0.3]])
    assert_lists_close(got.advantages, whiten_by_hand([adv0, adv1], [m.tolist() for m in masks]))
    with pytest.raises(ValueError, match="critic"):
        estimate("ppo", samples, s, AdvantageInputs())


def test_estimator_refusals_and_user_estimator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope' \(--advantage-estimator\)"):
        get_estimator("nope")
    (tmp_path / "my_adv.py").write_text(
        "import torch\n"
        "def good(samples, settings, inputs):\n    return [torch.full((s.response_length,), 2.0) for s in samples]\n"
        "def two_args(samples, settings):\n    return []\n"
        "def wrong_shape(samples, settings, inputs):\n    return [torch.zeros(1) for s in samples]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = [sample(0, 0, 1.0, 2), sample(0, 1, 0.0, 3)]
    got = estimate("my_adv:good", samples, AdvantageSettings())
    assert_lists_close(got.advantages, [[2.0, 2.0], [2.0, 2.0, 2.0]])
    with pytest.raises(ValueError, match="--advantage-estimator 'my_adv:two_args'.*signature"):
        get_estimator("my_adv:two_args")
    with pytest.raises(ValueError, match="returned shape"):
        estimate("my_adv:wrong_shape", samples, AdvantageSettings())
    sys.modules.pop("my_adv", None)


# --- losses ----------------------------------------------------------------------------------------


def loss_batch(logp, old, adv, mask, seq, n_seqs, token_denom, seq_denom, **kw) -> LossBatch:
    return LossBatch(logp=logp, entropy=torch.zeros_like(logp), loss_mask=mask, seq_index=torch.tensor(seq),
                     num_seqs=n_seqs, token_denom=token_denom, seq_denom=seq_denom, advantages=adv, old_logp=old, **kw)


def test_aggregation_token_mean_and_sequence_mean_by_hand() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 7.0], dtype=F64)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0], dtype=F64)
    b = loss_batch(x, x, x, mask, [0, 0, 0, 1, 2], 3, token_denom=8.0, seq_denom=4.0)
    assert float(aggregate(x, b, "token_mean")) == pytest.approx((1 + 2 + 10 + 7) / 8.0)
    assert float(aggregate(x, b, "sequence_mean")) == pytest.approx((1.5 + 10 + 7) / 4.0)


def test_gspo_loss_value_and_gradient_match_float64_sequence_objective() -> None:
    torch.manual_seed(0)
    seq = [0, 0, 0, 1, 2, 2]
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=F64)  # a masked token; a one-token sequence
    old = -torch.rand(6, dtype=F64) * 2
    logp0 = old + torch.tensor([0.01, 0.5, -0.02, 0.3, 0.0002, 0.0001], dtype=F64)
    adv = torch.tensor([1.0, 1.0, 1.0, 0.5, 2.0, 2.0], dtype=F64)
    low, high = 3e-4, 4e-4
    s = LossSettings(eps_clip=low, eps_clip_high=high, ratio_level="sequence", aggregation="sequence_mean")

    logp = logp0.clone().requires_grad_(True)
    loss, sums = policy_loss(loss_batch(logp, old, adv, mask, seq, 3, 5.0, 3.0), s)
    loss.backward()

    ref = logp0.clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for i, members in enumerate([[0, 2], [3], [4, 5]]):  # loss tokens of each sequence
        ratio = torch.exp(torch.stack([ref[t] - old[t] for t in members]).mean())
        a = adv[members[0]]
        total = total + torch.maximum(-a * ratio, -a * ratio.clamp(1 - low, 1 + high))
    (total / 3.0).backward()
    torch.testing.assert_close(loss.detach(), total.detach() / 3.0)
    torch.testing.assert_close(logp.grad, ref.grad)
    assert logp.grad[1] == 0.0
    # sequence 0: ratio exp(-0.005) < 1 with A > 0: the unclipped term wins -> gradient;
    # sequence 1: exp(0.3) > 1 + high with A > 0: clipped -> no gradient
    assert logp.grad[0] != 0.0 and logp.grad[3] == 0.0
    assert float(sums["pg_clipfrac"]) == 1.0  # the one loss token of sequence 1


def test_policy_loss_correction_weights_scale_each_tokens_term() -> None:
    logp = torch.tensor([-1.0, -0.5, -2.0], dtype=F64, requires_grad=True)
    old = torch.tensor([-1.0, -0.6, -2.0], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=F64)
    mask = torch.ones(3, dtype=F64)
    w = torch.tensor([0.5, 2.0, 0.0], dtype=F64)
    loss, _ = policy_loss(loss_batch(logp, old, adv, mask, [0, 0, 0], 1, 3.0, 1.0, weights=w), LossSettings())
    r1 = math.exp(0.1)
    want = (0.5 * -1.0 + 2.0 * max(r1, min(max(r1, 0.8), 1.2)) + 0.0) / 3.0
    assert float(loss) == pytest.approx(want, abs=1e-12)
    loss.backward()
    assert logp.grad[2] == 0.0 and logp.grad[0] == pytest.approx(-0.5 / 3.0)


def test_low_var_kl_is_k3_clamped() -> None:
    logp = torch.tensor([-1.0, -20.0, -0.5], dtype=F64)
    ref = torch.tensor([-1.5, -0.1, -0.5], dtype=F64)
    d = (logp - ref).tolist()
    k3 = [math.exp(-x) - 1 + x for x in d]
    got = kl_estimate(logp, ref, "low_var_kl")
    torch.testing.assert_close(got, torch.tensor([k3[0], 10.0, 0.0], dtype=F64))
    assert k3[1] > 10.0


def test_value_loss_clipped_against_hand_values() -> None:
    v = torch.tensor([0.5, 1.0, -0.2], dtype=F64, requires_grad=True)
    old = torch.tensor([0.4, 0.5, 0.0], dtype=F64)
    ret = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    b = loss_batch(v, v, v, mask, [0, 0, 1], 2, token_denom=2.0, seq_denom=2.0)
    loss, sums = value_loss(v, old, ret, b, LossSettings(value_clip=0.2))
    # token 0: unclipped (0.5-1)^2=0.25, clipped (0.5-1)^2 (0.5 within 0.4+-0.2) -> 0.25
    # token 1: unclipped 1.0, clipped V=0.7 -> 0.49 -> max 1.0; token 2 masked
    assert float(loss) == pytest.approx(0.5 * (0.25 + 1.0) / 2.0)
    assert float(sums["value_clipfrac"]) == 0.0
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([(0.5 - 1.0) / 2.0, 1.0 / 2.0, 0.0], dtype=F64))


def test_sft_loss_is_masked_nll() -> None:
    logp = torch.tensor([-1.0, -2.0, -3.0], dtype=F64, requires_grad=True)
    mask = torch.tensor([0.0, 1.0, 1.0], dtype=F64)
    b = loss_batch(logp, None, None, mask, [0, 0, 1], 2, token_denom=4.0, seq_denom=2.0)
    loss, sums = sft_loss(b, LossSettings())
    assert float(loss) == pytest.approx(5.0 / 4.0) and float(sums["sft_loss"]) == 5.0
    loss, _ = sft_loss(b, LossSettings(aggregation="sequence_mean"))
    assert float(loss) == pytest.approx((2.0 + 3.0) / 2.0)


def test_custom_loss_plugin_and_signature_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_loss.py").write_text(
        "def good(batch, settings):\n    return (-batch.logp * batch.loss_mask).sum() / batch.token_denom, {}\n"
        "def bad(batch):\n    return batch.logp.sum(), {}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_loss("custom_loss", "my_loss:good")
    logp = torch.tensor([-1.0, -2.0], dtype=F64)
    loss, _ = fn(loss_batch(logp, None, None, torch.ones(2, dtype=F64), [0, 0], 1, 2.0, 1.0), LossSettings())
    assert float(loss) == 1.5
    with pytest.raises(ValueError, match="--custom-loss-function-path 'my_loss:bad'.*signature"):
        get_loss("custom_loss", "my_loss:bad")
    with pytest.raises(ValueError, match="--custom-loss-function-path"):
        get_loss("custom_loss", "my_loss:missing")
    sys.modules.pop("my_loss", None)


# --- ratio corrections -----------------------------------------------------------------------------


def test_tis_and_clip_or_pop_weights_and_metrics_by_hand() -> None:
    ratios = [0.5, 1.0, 2.5, 1.5, 10.0]
    rollout = torch.tensor([-1.0, -2.0, -0.5, -1.2, -3.0])
    old = rollout + torch.tensor([math.log(r) for r in ratios])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # the 10x token is masked: no weight, no metric
    tis, m = ratio_weights(old, rollout, mask, CorrectionSettings("tis"))
    torch.testing.assert_close(tis, torch.tensor([0.5, 1.0, 2.0, 1.5, 0.0]))
    assert m["rollout_ratio"] == pytest.approx(0.5 + 1.0 + 2.5 + 1.5)
    assert m["rollout_ratio_clipfrac"] == 1.0
    assert m["rollout_ratio_abs_dev"] == pytest.approx(0.5 + 0.0 + 1.5 + 0.5)
    pop, m2 = ratio_weights(old, rollout, mask, CorrectionSettings("clip_or_pop", low=0.8, high=2.0))
    torch.testing.assert_close(pop, torch.tensor([0.0, 1.0, 0.0, 1.5, 0.0]))
    assert m2["rollout_ratio_clipfrac"] == 2.0 and m2["rollout_ratio"] == m["rollout_ratio"]
    with pytest.raises(ValueError, match="tis_clip_low"):
        CorrectionSettings("tis", low=2.0, high=1.0)
