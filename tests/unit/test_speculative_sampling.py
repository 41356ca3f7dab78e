"""The speculative verifier on fixed logits: samples follow the target's distribution exactly.

Chi-square goodness of fit over many independent verifications (one batch of requests per
setting, a fixed seed): the first token must follow q_0 (the target's distribution after the
last token, temperature and truncations applied) whatever was proposed, and the token after an
accepted proposal must follow q_1. A p-value below 1e-4 fails; with 15,000 draws, a verifier that
skipped the residual step or the acceptance test fails with p ~ 0. Greedy rows and log-probs are
checked exactly.
"""

from __future__ import annotations

import pytest
import torch

from milepost.engine.sampling import _truncate
from milepost.engine.sampling_params import SamplingParams
from milepost.engine.speculative_sampling import verify

V = 6
N = 15_000
P_FAIL = 1e-4
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -3.0],  # row 0: after the last token
                       [0.0, 1.5, -1.0, 0.8, 0.3, 0.1],  # row 1: after proposal 1
                       [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])  # row 2: after proposal 2


def target(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(row / p.temperature, dim=-1)[None].clone()
    _truncate(probs, [p])
    return (probs / probs.sum()).squeeze(0)


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of counts [V] to probs [V] (cells with probability 0 must be 0)."""
    assert counts[probs == 0].sum() == 0, f"drew a token of probability 0: {counts}"
    keep = probs > 0
    n = counts.sum()
    expected = n * probs[keep]
    chi2 = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         chi2.double() / 2))


def run(params: SamplingParams, drafts: list[int], draft_probs: torch.Tensor | None,
        seed: int = 0) -> tuple[list[list[int]], list[int]]:
    logits = LOGITS[: len(drafts) + 1].repeat(N, 1)
    g = torch.Generator().manual_seed(seed)
    v = verify(logits, [drafts] * N, [draft_probs] * N, [params] * N, [g] * N)
    return v.tokens, v.accepted


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
]


DRAFTS = {"likely": [0, 1], "unlikely": [4, 3], "banned": [5, 0]}  # 5: cut by top-k / min-p


@pytest.mark.parametrize("params", SETTINGS, ids=["plain", "top_k", "top_p", "min_p"])
def test_point_mass_proposals_keep_the_target_distribution(params: SamplingParams) -> None:
    # One batch: N requests for each kind of proposal (likely, unlikely, cut by the truncation).
    drafts = [d for d in DRAFTS.values() for _ in range(N)]
    logits = LOGITS.repeat(len(drafts), 1)
    g = torch.Generator().manual_seed(0)
    v = verify(logits, drafts, [None] * len(drafts), [params] * len(drafts), [g] * len(drafts))
    q0, q1 = target(LOGITS[0], params), target(LOGITS[1], params)
    for n, d in enumerate(DRAFTS.values()):
        tokens, accepted = v.tokens[n * N:(n + 1) * N], v.accepted[n * N:(n + 1) * N]
        first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=V).double()
        assert p_value(first, q0) > P_FAIL, d
        # The token after an accepted first proposal follows row 1's distribution.
        second = [t[1] for t, m in zip(tokens, accepted) if m >= 1]
        if len(second) > 1000:
            assert p_value(torch.bincount(torch.tensor(second), minlength=V).double(), q1) > P_FAIL
        # The first proposal is accepted with probability q0(d) exactly (5 standard deviations).
        rate = sum(m >= 1 for m in accepted) / N
        sd = (q0[d[0]] * (1 - q0[d[0]]) / N).sqrt().item()
        assert abs(rate - q0[d[0]].item()) <= 5 * sd + 1e-12, d


@pytest.mark.parametrize("params", SETTINGS[:3], ids=["plain", "top_k", "top_p"])
def test_draft_model_proposals_keep_the_target_distribution(params: SamplingParams) -> None:
    # A draft distribution unlike the target's; each request's proposals are drawn from it.
    p_draft = torch.tensor([[0.05, 0.1, 0.15, 0.3, 0.3, 0.1], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]])
    g = torch.Generator().manual_seed(7)
    d = torch.stack([torch.multinomial(p_draft[j], N, replacement=True, generator=g)
                     for j in range(2)], dim=1).tolist()
    logits = LOGITS.repeat(N, 1)
    gen = torch.Generator().manual_seed(1)
    v = verify(logits, d, [p_draft] * N, [params] * N, [gen] * N)
    first = torch.bincount(torch.tensor([t[0] for t in v.tokens]), minlength=V).double()
    assert p_value(first, target(LOGITS[0], params)) > P_FAIL
    second = [t[1] for t, m in zip(v.tokens, v.accepted) if m >= 1]
    assert p_value(torch.bincount(torch.tensor(second), minlength=V).double(),
                   target(LOGITS[1], params)) > P_FAIL


def test_a_verifier_without_the_residual_step_would_fail() -> None:
    """The test has power: drawing from q (not q without the rejected proposal) after a
    rejection over-weights the proposal, and the chi-square sees it."""
    params = SETTINGS[0]
    tokens, accepted = run(params, [0, 1], None)
    q0 = target(LOGITS[0], params)
    g = torch.Generator().manual_seed(3)
    wrong = [t[0] if m >= 1 else int(torch.multinomial(q0, 1, generator=g)) for t, m in
             zip(tokens, accepted)]
    assert p_value(torch.bincount(torch.tensor(wrong), minlength=V).double(), q0) < P_FAIL


def test_greedy_accepts_while_proposals_are_the_argmax() -> None:
    greedy = SamplingParams(temperature=0.0)
    # argmax of rows: 0, 1, 0 (ties: first index)
    v = verify(LOGITS, [[0, 1]], [None], [greedy], [None])
    assert v.tokens == [[0, 1, 0]] and v.accepted == [2]
    v = verify(LOGITS[:3], [[0, 3]], [None], [greedy], [None])
    assert v.tokens == [[0, 1]] and v.accepted == [1]
    v = verify(LOGITS[:2], [[2]], [None], [greedy], [None])
    assert v.tokens == [[0]] and v.accepted == [0]


def test_logprobs_are_the_targets_at_each_token() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)]
    logits = torch.cat([LOGITS, LOGITS[:2]])  # request 0: rows 0-2, request 1: rows 3-4
    v = verify(logits, [[0, 1], [0]], [None, None], params, [None, torch.Generator().manual_seed(0)])
    for i, (rows, temp) in enumerate([(range(0, 3), 1.0), (range(3, 5), 0.5)]):
        for j, tok in enumerate(v.tokens[i]):
            want = torch.log_softmax(logits[rows[j]] / temp, dim=-1)[tok].item()
            assert v.logprobs[i][j] == pytest.approx(want, abs=1e-6)
            assert v.rows[i][j] == rows[j]


def test_no_proposals_is_a_plain_draw() -> None:
    params = SETTINGS[1]
    logits = LOGITS[:1].repeat(N, 1)
    v = verify(logits, [[]] * N, [None] * N, [params] * N, [torch.Generator().manual_seed(5)] * N)
    counts = torch.bincount(torch.tensor([t[0] for t in v.tokens]), minlength=V).double()
    assert p_value(counts, target(LOGITS[0], params)) > P_FAIL
    assert set(v.accepted) == {0}
