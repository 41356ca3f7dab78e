"""The fused temperature-only sampler (milepost/kernels/fused_sampler.py), both methods (the
exponential race and the inverse CDF), run on CPU through Triton's interpreter (TRITON_INTERPRET,
set before triton is imported): greedy rows take the first maximum, log-probs are
log_softmax(logits / T) at the token, two work layouts (splits) draw the same tokens here
(log-probs differ in the last bits), a seed reproduces its draws, a -inf logit is never drawn,
and draws follow softmax(logits / T) (chi-square). The cdf method's exactness is checked
draw by draw in tests/unit/test_fused_sampler_cdf.py. The same checks at scale on CUDA:
tests/gpu/test_fused_sampler_cuda.py. The --sampling-backend refusals need no kernel."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from milepost.engine.server_args import ServerArgs

if not torch.cuda.is_available():  # must precede the first triton import (conftest sets it too)
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", params=["race", "cdf"])
def interpreted(request: pytest.FixtureRequest) -> dict:
    from milepost.kernels.fused_sampler import fused_sample as fused

    # cdf: 16-token chunks, so 37 logits are 3 chunks (the last one partial)
    opts = {"method": request.param} | ({"chunk": 16} if request.param == "cdf" else {})

    def fused_sample(*args: object, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        return fused(*args, **kw, **opts)

    torch.manual_seed(0)
    out: dict = {}
    # layout invariance, greedy, log-probs: 24 rows of 37 logits, a -inf column, a greedy tie
    logits = torch.randn(24, 37) * 2
    logits[:, 3] = float("-inf")
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # the first maximum must win
    temps = torch.full((24,), 0.7)
    temps[:4] = 1.0
    greedy = torch.zeros(24, dtype=torch.int8)
    greedy[:4] = 1
    seeds = torch.randint(0, 2**62, (24,))
    logits, temps, greedy, seeds = (t.to(DEV) for t in (logits, temps, greedy, seeds))
    runs = [fused_sample(logits, temps, greedy, seeds, splits=s) for s in (1, 4)]
    ref = torch.log_softmax(logits / temps[:, None], -1)
    tok, lp = runs[0]
    out["layouts_agree"] = all(torch.equal(r[0], tok) for r in runs)
    out["layout_logprob_diff"] = max(float((r[1] - lp).abs().max()) for r in runs)
    out["greedy_is_argmax"] = torch.equal(tok[:4], logits[:4].argmax(1)) and int(tok[0]) == 5
    out["logprob_err"] = float((lp - ref.gather(1, tok[:, None]).squeeze(1)).abs().max())
    ref64 = torch.log_softmax(logits.double() / temps.double()[:, None], -1)
    out["logprob_err64"] = float((lp - ref64.gather(1, tok[:, None]).squeeze(1)).abs().max())
    out["never_inf"] = bool((tok != 3).all())
    out["seed_repeats"] = torch.equal(fused_sample(logits, temps, greedy, seeds, splits=1)[0], tok)
    other = fused_sample(logits, temps, greedy, seeds + 1, splits=1)[0]
    out["other_seed_differs"] = not torch.equal(other[4:], tok[4:])
    # distribution: 200 draws (one row each: the interpreter's cost is per row) of 5 logits, T = 0.8
    n = 200
    base = torch.tensor([1.5, 0.8, 0.0, -0.7, float("-inf")], device=DEV)
    tok = fused_sample(base.repeat(n, 1), torch.full((n,), 0.8, device=DEV),
                       torch.zeros(n, dtype=torch.int8, device=DEV),
                       torch.randint(0, 2**62, (n,)).to(DEV), splits=1)[0]
    out["counts"] = torch.bincount(tok, minlength=5).tolist()
    out["expected"] = (torch.softmax(base / 0.8, 0) * n).tolist()
    return out


def test_layout_greedy_logprobs_and_seeds(interpreted: dict) -> None:
    assert interpreted["layouts_agree"]  # tokens; log-probs to the summation order
    assert interpreted["layout_logprob_diff"] < 1e-5
    assert interpreted["greedy_is_argmax"]
    assert interpreted["logprob_err"] < 1e-5
    assert interpreted["logprob_err64"] < 1e-5
    assert interpreted["never_inf"]
    assert interpreted["seed_repeats"] and interpreted["other_seed_differs"]


def chi_square_p(counts: list[int], expected: list[float]) -> float:
    """Goodness-of-fit p-value: P(chi2 with len - 1 degrees of freedom >= the statistic)."""
    c, e = torch.tensor(counts, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = ((c - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2, dtype=torch.float64),
                                         stat / 2))


def test_draws_follow_softmax(interpreted: dict) -> None:
    counts, expected = interpreted["counts"], interpreted["expected"]
    assert counts[4] == 0  # the -inf token
    assert chi_square_p(counts[:4], expected[:4]) > 1e-4, (counts, expected)
    # the test can fail: the same counts against a uniform guess
    assert chi_square_p(counts[:4], [sum(counts) / 4] * 4) < 1e-4


def test_fused_call_site_seeds_rows_by_their_own_generator() -> None:
    """sampling._fused (what sample(fused=True) runs on CUDA) on the interpreter: a seeded row
    draws the same token alone or in a mixed batch (its kernel seed comes from its own generator
    only), greedy rows take argmax, a batch of one shared generator repeats under the same seed,
    and the log-probs are log_softmax(logits / T) at the token."""
    from milepost.engine.sampling import SamplingParams, _fused

    torch.manual_seed(1)
    logits = (torch.randn(6, 37) * 2).to(DEV)
    temps = [0.9, 1.0, 0.0, 0.6, 1.0, 1.3]  # row 2 greedy

    def gen(seed: int) -> torch.Generator:
        return torch.Generator(DEV).manual_seed(seed)

    shared = gen(99)
    gens = [gen(7), shared, shared, gen(8), shared, shared]
    params = [SamplingParams(temperature=t) for t in temps]
    batch = _fused(logits, params, gens)
    alone = [_fused(logits[i:i + 1], params[i:i + 1], [gen(s)]).tokens for i, s in ((0, 7), (3, 8))]
    assert [int(batch.tokens[0]), int(batch.tokens[3])] == [int(a) for a in alone]
    assert int(batch.tokens[2]) == int(logits[2].argmax())
    t = torch.tensor([1.0 if x == 0 else x for x in temps], device=DEV)
    ref = torch.log_softmax(logits / t[:, None], -1).gather(1, batch.tokens[:, None]).squeeze(1)
    assert (batch.logprobs - ref).abs().max() < 1e-5
    same = [SamplingParams(temperature=0.8)] * 6
    runs = [_fused(logits, same, [gen(5)] * 6).tokens for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], _fused(logits, same, [gen(6)] * 6).tokens)


def test_method_refusals() -> None:
    from milepost.kernels.fused_sampler import fused_sample

    x, t, g, s = torch.zeros(2, 8, device=DEV), torch.ones(2, device=DEV), \
        torch.zeros(2, dtype=torch.int8, device=DEV), torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="method='gumbel' is not one of"):
        fused_sample(x, t, g, s, method="gumbel")
    with pytest.raises(ValueError, match="chunk=24 must be a power of two"):
        fused_sample(x, t, g, s, method="cdf", chunk=24)
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_sample(torch.zeros(8, 2, device=DEV).t(), t, g, s)


def test_sampling_backend_refusals(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="--sampling-backend triton runs a GPU kernel"):
        ServerArgs(model_path=tmp_path, device="cpu", sampling_backend="triton").resolved()
    assert ServerArgs(model_path=tmp_path, device="cpu").resolved().sampling_backend == "pytorch"
