"""Sampler: greedy, truncation, reported log-probs, bans, seeds, top log-probs; param checks."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from milepost.engine.sampling import SamplingParams, sample

V = 32


def _logits(batch: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def _ref_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.double() / temperature, dim=-1)


def _draw(logits_row: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n samples of one row, drawn as one batch of n identical rows sharing a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    res = sample(logits_row.expand(n, -1).clone(), [p] * n, [g] * n, [[]] * n)
    return res.tokens


def test_greedy_is_argmax_and_reports_temperature_one_logprobs() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6)] * 3
    res = sample(logits.clone(), params, [None] * 6, [[]] * 6)
    assert torch.equal(res.tokens, logits.argmax(-1))
    ref = _ref_logprobs(logits, 1.0).gather(1, res.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(res.logprobs.double(), ref, atol=1e-5, rtol=0)
    assert res.top_ids is None and res.top_logprobs is None


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.5},
        {"temperature": 0.9, "min_p": 0.2},
        {"temperature": 2.0, "top_k": 5, "top_p": 0.8, "min_p": 0.05},
    ],
)
def test_logprob_is_before_truncation(kw: dict) -> None:
    logits = _logits(8, seed=1)
    p = SamplingParams(**kw)
    res = sample(logits.clone(), [p] * 8, [torch.Generator().manual_seed(3)] * 8, [[]] * 8)
    ref = _ref_logprobs(logits, p.temperature).gather(1, res.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(res.logprobs.double(), ref, atol=1e-5, rtol=0)
    assert res.logprobs.dtype == torch.float32


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_top_k_samples_only_the_k_most_likely() -> None:
    logits = _logits(1, seed=2)[0]
    allowed = set(logits.topk(3).indices.tolist())
    tokens = _draw(logits, SamplingParams(temperature=1.5, top_k=3), 3000)
    assert set(tokens.tolist()) == allowed


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = _probs_logits([0.05, 0.5, 0.1, 0.3, 0.05])
    # sorted: 0.5, 0.3, 0.1, 0.05, 0.05 -> mass before each: 0, .5, .8, .9, .95
    tokens = _draw(logits, SamplingParams(top_p=0.7), 4000)
    assert set(tokens.tolist()) == {1, 3}
    freq1 = (tokens == 1).float().mean().item()
    assert abs(freq1 - 0.5 / 0.8) < 0.04, "kept tokens keep their relative weights"
    tokens = _draw(logits, SamplingParams(top_p=0.85), 4000, seed=1)
    assert set(tokens.tolist()) == {1, 3, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    logits = _probs_logits([0.05, 0.5, 0.1, 0.3, 0.05])
    tokens = _draw(logits, SamplingParams(min_p=0.25), 4000)  # threshold 0.125
    assert set(tokens.tolist()) == {1, 3}
    tokens = _draw(logits, SamplingParams(min_p=0.15), 4000, seed=1)  # threshold 0.075
    assert set(tokens.tolist()) == {1, 2, 3}


def test_temperature_sharpens_the_distribution() -> None:
    logits = _probs_logits([0.4, 0.6])
    cold = (_draw(logits, SamplingParams(temperature=0.25), 4000) == 1).float().mean().item()
    # p(1) at T=0.25 = .6^4 / (.6^4 + .4^4) ~ 0.835
    assert abs(cold - 0.6**4 / (0.6**4 + 0.4**4)) < 0.03


def test_banned_ids_are_never_sampled() -> None:
    logits = _logits(1, seed=4)[0]
    best = int(logits.argmax())
    greedy = sample(logits[None].clone(), [SamplingParams(temperature=0)], [None], [[best]])
    assert int(greedy.tokens[0]) == int(logits.topk(2).indices[1])

    banned = logits.topk(4).indices.tolist()
    g = torch.Generator().manual_seed(0)
    n = 2000
    res = sample(logits.expand(n, -1).clone(), [SamplingParams(temperature=2.0)] * n, [g] * n,
                 [banned] * n)
    assert not set(res.tokens.tolist()) & set(banned)


def test_sample_does_not_modify_the_callers_logits() -> None:
    logits = _logits(2, seed=5)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0), SamplingParams()], [None, None], [[1, 2], [3]])
    assert torch.equal(logits, before)


def test_same_seed_gives_the_same_tokens() -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(1234)
        runs.append([int(sample(_logits(1, seed=s), [p], [g], [[]]).tokens[0]) for s in range(30)])
    assert runs[0] == runs[1]
    g = torch.Generator().manual_seed(999)
    other = [int(sample(_logits(1, seed=s), [p], [g], [[]]).tokens[0]) for s in range(30)]
    assert other != runs[0], "a different seed should differ somewhere in 30 draws"


def test_seeded_row_is_independent_of_batch_composition() -> None:
    p = SamplingParams(temperature=1.2, top_k=20)
    others = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01)]
    g_alone = torch.Generator().manual_seed(77)
    g_batch = torch.Generator().manual_seed(77)
    g_other = torch.Generator().manual_seed(5)
    alone, batched = [], []
    for step in range(40):
        row = _logits(1, seed=100 + step)
        r1 = sample(row.clone(), [p], [g_alone], [[]], top_logprobs_num=2)
        batch = torch.cat([_logits(1, seed=200 + step), row, _logits(1, seed=300 + step)])
        r2 = sample(batch, [others[0], p, others[1]], [g_other, g_batch, g_other], [[], [], [7]],
                    top_logprobs_num=4)
        alone.append((int(r1.tokens[0]), float(r1.logprobs[0])))
        batched.append((int(r2.tokens[1]), float(r2.logprobs[1])))
    assert alone == batched


def test_top_logprobs_ids_and_values() -> None:
    logits = _logits(3, seed=6)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5), SamplingParams()]
    res = sample(logits.clone(), params, [None] * 3, [[]] * 3, top_logprobs_num=4)
    assert res.top_ids is not None and res.top_logprobs is not None
    assert res.top_ids.shape == (3, 4) and res.top_logprobs.shape == (3, 4)
    for i, temp in enumerate([1.0, 0.5, 1.0]):  # greedy rows report temperature 1
        ref = _ref_logprobs(logits[i], temp)
        ref_vals, ref_ids = ref.topk(4)
        assert res.top_ids[i].tolist() == ref_ids.tolist()
        torch.testing.assert_close(res.top_logprobs[i].double(), ref_vals, atol=1e-5, rtol=0)
    # more than the vocabulary: clamped
    small = sample(_logits(1, vocab=3), [SamplingParams()], [None], [[]], top_logprobs_num=10)
    assert small.top_ids is not None and small.top_ids.shape == (1, 3)
    assert math.isclose(small.top_logprobs.exp().sum().item(), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"temprature": 0.5}, "temprature"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_sampling_params_validation(kw: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**kw)


def test_sampling_params_normalize_stop_and_greedy() -> None:
    assert SamplingParams(stop="</s>").stop == ["</s>"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.1).greedy
    assert SamplingParams(min_new_tokens=4, max_new_tokens=4).min_new_tokens == 4


# ---- the fast batched sampler against the former row-by-row one (milepost.testing) ----------

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.01),
    SamplingParams(temperature=1.0, top_p=0.999),  # a nucleus wider than the sorted candidates
    SamplingParams(temperature=1e-6),
]


@pytest.mark.parametrize("vocab", [32, 1000, 5003])
def test_mixed_batch_matches_the_row_by_row_sampler(vocab: int) -> None:
    """Every row of a batch mixing greedy, plain temperature and each truncation draws the same
    token and reports the same log-prob as the former per-row sampler, seeded per row or with a
    generator shared by several rows, with bans and top log-probs, over many steps."""
    from milepost.testing.reference_sampling import reference_sample

    params = MIXED * 3
    n = len(params)
    banned = [[3, 4] if i % 5 == 0 else [] for i in range(n)]

    def generators(seed: int) -> list[torch.Generator]:
        shared = torch.Generator().manual_seed(seed)  # unseeded requests share the engine's
        return [torch.Generator().manual_seed(seed + i) if i % 2 else shared for i in range(n)]

    gens_new, gens_old = generators(11), generators(11)
    for step in range(6):
        logits = _logits(n, seed=step, vocab=vocab) * (0.3 if step % 2 else 3.0)
        new = sample(logits.clone(), params, gens_new, banned, top_logprobs_num=3)
        old = reference_sample(logits.clone(), params, gens_old, banned, top_logprobs_num=3)
        assert torch.equal(new.tokens, old.tokens), f"step {step}"
        assert torch.equal(new.logprobs, old.logprobs)
        assert torch.equal(new.top_ids, old.top_ids)
        assert torch.equal(new.top_logprobs, old.top_logprobs)


def test_wide_nucleus_falls_back_to_a_full_sort() -> None:
    """top_p close to 1 on flat logits keeps more tokens than the sorted candidates hold; the
    rows that spill are sorted whole, so no token outside the nucleus is ever drawn."""
    from milepost.engine import sampling

    vocab = sampling.TOP_P_CANDIDATES * 3
    logits = torch.zeros(1, vocab)
    logits[0, :10] = -30.0  # ten tokens with almost no mass: outside a 0.999 nucleus
    p = SamplingParams(top_p=0.999)
    g = torch.Generator().manual_seed(0)
    n = 64
    res = sample(logits.expand(n, -1).clone(), [p] * n, [g] * n, [[]] * n)
    drawn = set(res.tokens.tolist())
    assert not drawn & set(range(10))
    assert len(drawn) > 50, "tokens beyond the first candidates are drawn"
    assert max(drawn) >= sampling.TOP_P_CANDIDATES
