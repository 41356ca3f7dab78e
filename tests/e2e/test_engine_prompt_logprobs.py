"""Prompt log-probs survive chunked prefill and preemption (in-process engine, tiny KV pool).

A preempted request (its KV dropped, its tokens recomputed later) keeps the prompt log-probs it
has and never scores a position twice; every value must equal the one an unhindered run computes.
Chunk sizes 16 and 7 split the prompts across steps (7 also leaves 1-token remainders).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine

PROMPTS = [[(5 * i + 11 * k) % 500 for i in range(40)] for k in range(3)]


def _run(model_dir: Path, *, max_total_tokens: int, chunk: int) -> tuple[list[RequestOutput], int]:
    args = ServerArgs(model_path=model_dir, max_total_tokens=max_total_tokens,
                      chunked_prefill_size=chunk).resolved()
    engine, _, _ = build_engine(args)
    outs: list[RequestOutput] = []
    for k, prompt in enumerate(PROMPTS):
        engine._add(Request(
            rid=str(k), prompt_ids=prompt, on_output=outs.append, stop_ids=frozenset(),
            params=SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
            return_logprob=True, top_logprobs_num=2, logprob_start_len=0, token_ids_logprob=[7, 9]))
    steps = 0
    while engine.scheduler.has_work:
        engine.step()
        steps += 1
        assert steps < 10_000
    return sorted(outs, key=lambda o: o.rid), engine.scheduler.num_preemptions


@pytest.mark.parametrize("chunk", [16, 7])
def test_prompt_logprobs_under_preemption_match_an_unhindered_run(qwen3_dir: Path, chunk: int) -> None:
    torch.set_num_threads(1)
    want, _ = _run(qwen3_dir, max_total_tokens=4096, chunk=512)
    got, preemptions = _run(qwen3_dir, max_total_tokens=112, chunk=chunk)  # 7 blocks; 4 each
    assert preemptions > 0, "the pool was meant to be too small for all three at once"
    for g, w in zip(got, want):
        assert len(g.input_logprobs) == len(PROMPTS[int(g.rid)]) and g.input_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(g.input_logprobs[1:]),
                                   torch.tensor(w.input_logprobs[1:]), atol=1e-5, rtol=0)
        assert len(g.input_top_logprobs) == len(w.input_top_logprobs)
        assert [r and [t for _, t in r] for r in g.input_top_logprobs] == \
            [r and [t for _, t in r] for r in w.input_top_logprobs]
        torch.testing.assert_close(torch.tensor(g.input_ids_logprobs[1:]),
                                   torch.tensor(w.input_ids_logprobs[1:]), atol=1e-5, rtol=0)
        assert g.new_token_ids == w.new_token_ids
