"""Speculative decoding on a CUDA device: verify steps replayed by the decode CUDA graphs as
one-token rows (or eagerly on the Triton kernels, `ModelRunner.verify_in_graphs` off), the draft
model on the device, the verifier with CUDA generators.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_speculative_cuda.py`.
Greedy outputs are compared with the same engine without speculation (fp32, decode CUDA graphs on):
batches of other sizes split the decode kernel's work otherwise (and the eager verify runs the
prefill kernel), so the logits may differ in the last bits; the tokens must agree up to a position
where the plain run's two best tokens are tied within 1e-3 (after which the sequences may part).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.engine import Engine
from milepost.engine.request import Request, RequestOutput
from milepost.engine.runner import ModelRunner
from milepost.engine.sampling import SamplingParams
from milepost.engine.sampling_params import SamplingParams as Params
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.engine.speculative_sampling import verify
from milepost.testing.checkpoints import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
TIE = 1e-3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec_cuda") / "qwen3", "qwen3", seed=0,
                                with_tokenizer=False)


def make_engine(path: Path, **flags: object) -> Engine:
    settings = dict(device="cuda", dtype="float32", page_size=16, max_total_tokens=16384,
                    mem_fraction_static=0.5, max_running_requests=64) | flags
    return build_engine(ServerArgs(model_path=path, **settings).resolved())[0]


def generate(engine: Engine, prompts: list[list[int]], n: int) -> dict[int, list[RequestOutput]]:
    out: dict[int, list[RequestOutput]] = {}
    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                              on_output=lambda o, i=i: out.setdefault(i, []).append(o),
                              return_logprob=True, top_logprobs_num=2))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    torch.cuda.synchronize()
    return out


def looping_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        phrase = torch.randint(3, 500, (3 + i % 5,), generator=g).tolist()
        out.append(phrase * 4 + phrase[:2])
    return out


def agree(plain: list[RequestOutput], spec: list[RequestOutput]) -> int:
    """Positions compared before a tie let the sequences part; fails on a real difference."""
    a = [t for o in plain for t in o.new_token_ids]
    b = [t for o in spec for t in o.new_token_ids]
    top = [t for o in plain for t in o.new_top_logprobs]
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            gap = top[j][0][0] - top[j][1][0]
            assert gap < TIE, f"position {j}: {x} vs {y}, the plain run's top-2 gap {gap:.2e}"
            return j
    assert len(a) == len(b)
    return len(a)


@pytest.mark.parametrize("algo,in_graphs", [("NGRAM", True), ("STANDALONE", True), ("NGRAM", False)])
def test_greedy_speculation_on_cuda_matches_the_plain_engine(algo: str, in_graphs: bool, ckpt: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ModelRunner, "verify_in_graphs", in_graphs)
    prompts = looping_prompts(24)
    plain_engine = make_engine(ckpt)
    assert plain_engine.runner.graphs is not None, "decode CUDA graphs should be on"
    plain = generate(plain_engine, prompts, 48)
    flags = {"speculative_algorithm": algo}
    if algo == "STANDALONE":
        flags["speculative_draft_model_path"] = ckpt
    engine = make_engine(ckpt, **flags)
    assert engine.runner.graphs is not None, "decode CUDA graphs stay on beside verify steps"
    catch_ups: list[bool] = []
    if algo == "STANDALONE":  # the draft's catch-ups after a verify replay its step graphs too
        graphs = engine.speculator.drafter.graphs
        run = graphs.run
        monkeypatch.setattr(graphs, "run", lambda chunks, *a, **kw: catch_ups.append(
            kw.get("rows") is not None) or run(chunks, *a, **kw))
    spec = generate(engine, prompts, 48)
    assert any(catch_ups) == (algo == "STANDALONE"), catch_ups.count(True)
    compared = sum(agree(plain[i], spec[i]) for i in plain)
    assert compared >= 0.9 * 24 * 48, f"only {compared} positions before ties"
    stats = engine.speculator.stats
    assert stats.accepted > 0 and stats.accept_length > 1.5, stats
    replays = engine.runner.verify_replays
    assert (replays > 0) if in_graphs else (replays == 0), replays
    for i in plain:  # the target's log-probs, up to kernel rounding
        a = [x for o in plain[i] for x in o.new_logprobs]
        b = [x for o in spec[i] for x in o.new_logprobs]
        n = agree(plain[i], spec[i])
        assert torch.allclose(torch.tensor(a[:n]), torch.tensor(b[:n]), atol=1e-3)


def test_verifier_on_cuda_keeps_the_target_distribution() -> None:
    """The verifier's device paths (pinned copies, CUDA generators): chi-square of first tokens."""
    n = 20_000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -3.0], [0.0, 1.5, -1.0, 0.8, 0.3, 0.1]],
                          device="cuda")
    params = Params(temperature=0.8, top_p=0.9)
    g = torch.Generator(device="cuda").manual_seed(0)
    v = verify(logits.repeat(n, 1), [[1]] * n, [None] * n, [params] * n, [g] * n)
    counts = torch.bincount(torch.tensor([t[0] for t in v.tokens]), minlength=6).double()
    probs = torch.softmax(logits[0].cpu() / 0.8, dim=-1)
    vals, idx = probs.sort(descending=True)
    keep = (vals.cumsum(0) - vals) < 0.9
    q = torch.zeros(6, dtype=torch.float64)
    q[idx[keep]] = vals[keep].double()
    q /= q.sum()
    assert counts[q == 0].sum() == 0
    expected = n * q[q > 0]
    chi2 = ((counts[q > 0] - expected) ** 2 / expected).sum()
    p = torch.special.gammaincc(torch.tensor((int((q > 0).sum()) - 1) / 2, dtype=torch.float64),
                                chi2 / 2)
    assert p > 1e-4, (counts, q)
