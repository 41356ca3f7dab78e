"""The fused temperature-only sampler on CUDA (milepost/kernels/fused_sampler.py), both methods
("race" and "cdf"): draws follow softmax(logits / T) (chi-square, a small and a full Qwen3-size
vocabulary), greedy rows equal argmax, log-probs equal log_softmax at the token, bf16 logits draw
what their fp32 values draw, the cdf method draws the long tail at its true rate (a token of
probability 1e-8, below fp32's 2^-24 uniform step; the race's count is printed beside it), and an
engine with --sampling-backend triton gives the pytorch sampler's greedy tokens and seeded runs
that repeat. The CPU tests of tests/unit/test_fused_sampler*.py also run here, on the GPU's kernels.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_fused_sampler_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.engine import Engine
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    c, e = counts.double().cpu(), expected.double().cpu()
    stat = ((c - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(c) - 1) / 2, dtype=torch.float64), stat / 2))


METHODS = ["race", "cdf"]


def draw(logits_row: torch.Tensor, n: int, temperature: float, method: str) -> torch.Tensor:
    from milepost.kernels.fused_sampler import fused_sample

    seeds = torch.randint(0, 2**62, (n,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    # n rows that all read the one row (row stride 0): no n x V copy (400,000 x 151,936 x 4 bytes)
    tok, _ = fused_sample(logits_row.expand(n, -1), torch.full((n,), temperature, device="cuda"),
                          torch.zeros(n, dtype=torch.int8, device="cuda"), seeds, method=method)
    return tok


@pytest.mark.parametrize("method", METHODS)
def test_small_vocab_draws_follow_softmax(method: str) -> None:
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf"), 1.5], device="cuda")
    n = 200_000
    counts = torch.bincount(draw(row, n, 0.8, method), minlength=8)
    assert counts[6] == 0
    expected = torch.softmax(row / 0.8, 0) * n
    keep = expected > 0
    assert chi_square_p(counts[keep], expected[keep]) > 1e-4, (counts, expected)


@pytest.mark.parametrize("method", METHODS)
def test_full_vocab_draws_follow_softmax(method: str) -> None:
    """151,936 logits (75 blocks of 2048, a partial last block): the 30 likeliest tokens and the
    rest as one bucket."""
    g = torch.Generator("cuda").manual_seed(0)
    row = torch.randn(151_936, device="cuda", generator=g) * 3
    n = 100_000
    tok = draw(row, n, 1.0, method)
    p = torch.softmax(row, 0)
    top = p.topk(30).indices
    counts = torch.cat([(tok[:, None] == top[None, :]).sum(0), ((tok[:, None] != top[None, :]).all(1)).sum()[None]])
    expected = torch.cat([p[top], (1 - p[top].sum())[None]]) * n
    assert chi_square_p(counts, expected) > 1e-4


def test_tail_drawn_at_its_rate() -> None:
    """Token 0 at logit 0, the other 151,935 at -18.4 (probability 1.0e-8 each, 1.55e-3 in all):
    400,000 draws must hit the tail ~620 times. The cdf method's picks resolve such masses; the
    race cannot (q = -log u with u in fp32 is never below 2^-24 = 6e-8), so its count is only
    printed (benchmarks/race_tail_sim.py, its arithmetic simulated on the CPU: ~6 of 400,000)."""
    row = torch.full((151_936,), -18.4, device="cuda")
    row[0] = 0.0
    p_tail = float(1 - torch.softmax(row.double(), 0)[0])
    n = 400_000
    counts = {m: int((draw(row, n, 1.0, m) != 0).sum()) for m in METHODS}
    print(f"tail draws of {n}: expected {p_tail * n:.0f}, cdf {counts['cdf']}, race {counts['race']}")
    sd = (n * p_tail * (1 - p_tail)) ** 0.5
    assert abs(counts["cdf"] - n * p_tail) < 5 * sd, (counts, p_tail * n)


@pytest.mark.parametrize("method", METHODS)
def test_bf16_logits_draw_what_their_fp32_values_draw(method: str) -> None:
    from milepost.kernels.fused_sampler import fused_sample

    g = torch.Generator("cuda").manual_seed(4)
    logits = (torch.randn(64, 151_936, device="cuda", generator=g) * 3).bfloat16()
    temps = torch.full((64,), 0.9, device="cuda")
    greedy = torch.zeros(64, dtype=torch.int8, device="cuda")
    greedy[::8] = 1
    temps[::8] = 1.0
    seeds = torch.randint(0, 2**62, (64,), device="cuda", generator=g)
    tok, lp = fused_sample(logits, temps, greedy, seeds, method=method)
    tok32, lp32 = fused_sample(logits.float(), temps, greedy, seeds, method=method)
    assert torch.equal(tok, tok32)
    assert (lp - lp32).abs().max() < 1e-6


@pytest.mark.parametrize("method", METHODS)
def test_greedy_and_logprobs_on_real_sizes(method: str) -> None:
    from milepost.kernels.fused_sampler import fused_sample

    g = torch.Generator("cuda").manual_seed(2)
    logits = torch.randn(256, 151_936, device="cuda", generator=g) * 4
    temps = torch.full((256,), 0.7, device="cuda")
    temps[:64] = 1.0
    greedy = torch.zeros(256, dtype=torch.int8, device="cuda")
    greedy[:64] = 1
    seeds = torch.randint(0, 2**62, (256,), device="cuda", generator=g)
    tok, lp = fused_sample(logits, temps, greedy, seeds, method=method)
    assert torch.equal(tok[:64], logits[:64].argmax(1))
    ref = torch.log_softmax(logits / temps[:, None], -1).gather(1, tok[:, None]).squeeze(1)
    assert (lp - ref).abs().max() < 1e-4
    # another layout, the same draws (race: no near-ties here; cdf: a chunk's sums do not
    # depend on the split)
    tok2, _ = fused_sample(logits, temps, greedy, seeds, splits=2, num_warps=4, method=method)
    assert torch.equal(tok, tok2)
    tok3, _ = fused_sample(logits, temps, greedy, seeds, method=method)
    assert torch.equal(tok, tok3)  # run to run


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fused_sampler") / "qwen3", "qwen3", seed=0,
                                with_tokenizer=False)


def run(engine: Engine, temperature: float, seed: int | None) -> list[list[int]]:
    out: dict[int, list[RequestOutput]] = {}
    for i in range(16):
        engine.submit(Request(rid=str(i), prompt_ids=list(range(3 + i, 20 + i)), stop_ids=frozenset(),
                              params=SamplingParams(max_new_tokens=24, temperature=temperature,
                                                    ignore_eos=True, sampling_seed=seed),
                              on_output=lambda o, i=i: out.setdefault(i, []).append(o),
                              return_logprob=True))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    return [[t for o in out[i] for t in o.new_token_ids] for i in range(16)]


def test_engine_with_the_fused_sampler(ckpt: Path) -> None:
    def make(backend: str) -> Engine:
        return build_engine(ServerArgs(model_path=ckpt, device="cuda", dtype="float32", page_size=16,
                                       max_total_tokens=8192, mem_fraction_static=0.3,
                                       sampling_backend=backend).resolved())[0]

    fused, plain = make("triton"), make("pytorch")
    assert fused.cfg.fused_sampler and not plain.cfg.fused_sampler
    assert run(fused, 0.0, None) == run(plain, 0.0, None)
    a, b = run(fused, 1.0, 7), run(fused, 1.0, 7)
    assert a == b  # seeded requests repeat
    assert a != run(fused, 1.0, 8)
