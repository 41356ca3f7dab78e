"""Penalties, logit_bias, the top_p floor and SGLang's parameter rules (null = default, strict types)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from milepost.engine.sampling import SamplingParams, sample

V = 40


def _logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed)) * 3.0


def _reference(row: torch.Tensor, p: SamplingParams, out: list[int]) -> torch.Tensor:
    """One row, token by token, as SGLang defines the penalties (output tokens only)."""
    row = row.double().clone()
    for t in set(out):
        count = out.count(t)
        if p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        row[t] -= p.frequency_penalty * count + p.presence_penalty
    for key, value in (p.logit_bias or {}).items():
        row[int(key)] += value
    return row


CASES = [
    SamplingParams(temperature=0.8, frequency_penalty=0.7),
    SamplingParams(temperature=1.0, presence_penalty=-1.5),
    SamplingParams(temperature=1.2, repetition_penalty=1.6),
    SamplingParams(temperature=0.9, repetition_penalty=0.5, frequency_penalty=0.3,
                   presence_penalty=0.4, logit_bias={"3": 5.0, "7": -2.5}),
    SamplingParams(temperature=1.0),  # an untouched row in the same batch
    SamplingParams(temperature=0.0, logit_bias={"11": 100.0}),
]
OUTPUTS = [[1, 1, 2, 5, 5, 5], [4, 4, 9], [0, 3, 3, 8], [3, 7, 7, 1], [1, 2, 3], []]


def test_penalties_and_bias_match_a_per_row_reference() -> None:
    logits = _logits(len(CASES))
    res = sample(logits.clone(), CASES, [torch.Generator().manual_seed(i) for i in range(6)],
                 [[]] * 6, outputs=OUTPUTS)
    for i, (p, out) in enumerate(zip(CASES, OUTPUTS)):
        ref = _reference(logits[i], p, out)
        t = 1.0 if p.greedy else p.temperature
        want = torch.log_softmax(ref / t, dim=-1)[res.tokens[i]]
        assert res.logprobs[i].item() == pytest.approx(want.item(), abs=1e-5), i
    assert res.tokens[5].item() == 11, "a +100 bias wins the argmax"


def test_penalized_row_samples_from_the_penalized_distribution() -> None:
    # Token 0 is by far the most likely; a presence penalty after it appeared makes it rare.
    logits = torch.zeros(1, V)
    logits[0, 0] = 4.0
    p = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    n = 2000
    res = sample(logits.expand(n, -1).clone(), [p] * n, [torch.Generator().manual_seed(0)] * n,
                 [[]] * n, outputs=[[0, 0]] * n)
    share = (res.tokens == 0).float().mean().item()
    # logit 4 - 2*2 - 2 = -2 against 39 zeros: p(0) = e^-2 / (e^-2 + 39) ~ 0.0035
    assert share < 0.02
    plain = sample(logits.expand(n, -1).clone(), [SamplingParams()] * n,
                   [torch.Generator().manual_seed(0)] * n, [[]] * n, outputs=[[0, 0]] * n)
    assert (plain.tokens == 0).float().mean().item() > 0.4  # e^4 / (e^4 + 39) ~ 0.58


def test_unused_adjustments_leave_the_logits_alone() -> None:
    logits = _logits(3, seed=2)
    params = [SamplingParams(temperature=0.0)] * 3
    a = sample(logits.clone(), params, [None] * 3, [[]] * 3)
    b = sample(logits.clone(), params, [None] * 3, [[]] * 3, outputs=[[1], [2], [3]])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)


def test_top_p_that_underflows_keeps_the_most_likely_token() -> None:
    logits = _logits(64, seed=3)
    p = SamplingParams(top_p=1e-300)
    res = sample(logits.clone(), [p] * 64, [torch.Generator().manual_seed(1)] * 64, [[]] * 64)
    assert torch.equal(res.tokens, logits.argmax(-1))
    assert (res.tokens != 0).any()


def test_null_means_default() -> None:
    p = SamplingParams.model_validate({"temperature": None, "top_p": None, "top_k": None,
                                       "stop": None, "frequency_penalty": None, "n": None,
                                       "custom_params": None, "logit_bias": None})
    assert p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == -1 and p.n == 1
    assert SamplingParams.model_validate({"max_new_tokens": None}).max_new_tokens is None


@pytest.mark.parametrize("bad", [
    {"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0},
    {"repetition_penalty": 2.1}, {"logit_bias": {"x": 1.0}}, {"logit_bias": {"-1": 1.0}},
    {"stop_regex": "("}, {"regex": "a+", "json_schema": "{}"}, {"structural_tag": "{}"}, {"ebnf": ""},
    {"temperature": float("inf")}, {"top_p": float("nan")}, {"logit_bias": {"1": float("inf")}},
    {"max_new_tokens": "8"}, {"ignore_eos": "yes"}, {"stop_token_ids": [True]},
    {"stream_interval": 0}, {"temprature": 1.0},
])
def test_bad_values_are_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        SamplingParams.model_validate(bad)


def test_sglang_fields_at_their_defaults_are_accepted() -> None:
    p = SamplingParams.model_validate({
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
        "stop_regex": None, "logit_bias": None, "json_schema": None, "regex": None, "ebnf": None,
        "structural_tag": None, "stream_interval": 2, "custom_params": {"a": 1, "b": [1, "x"]},
        "spaces_between_special_tokens": True})
    assert not p.adjusts_logits and p.custom_params == {"a": 1, "b": [1, "x"]}
