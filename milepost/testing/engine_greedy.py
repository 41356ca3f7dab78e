"""Greedy decoding on an in-process engine (no server thread): the tokens and log-probs of each
prompt, for tests that compare two engines' outputs."""

from __future__ import annotations

from typing import Any

import torch

from milepost.engine.request import Request
from milepost.engine.sampling_params import SamplingParams


def random_prompts(lengths: tuple[int, ...], seed: int, high: int = 500) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (n,), generator=g).tolist() for n in lengths]


def greedy_outputs(engine: Any, prompts: list[list[int]], max_new_tokens: int,
                   ) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt decoded greedily for exactly `max_new_tokens` (EOS ignored), stepped to the end."""
    toks: dict[int, list[int]] = {}
    lps: dict[int, list[float]] = {}

    def out(o: Any, i: int) -> None:
        toks.setdefault(i, []).extend(o.new_token_ids)
        lps.setdefault(i, []).extend(o.new_logprobs)

    for i, p in enumerate(prompts):
        engine.submit(Request(rid=str(i), prompt_ids=p, stop_ids=frozenset(), return_logprob=True,
                              params=SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                    ignore_eos=True),
                              on_output=lambda o, i=i: out(o, i)))
    engine._drain_inbox(block=False)
    while engine.scheduler.has_work:
        engine.step()
    engine._flush()
    return [toks[i] for i in range(len(prompts))], [lps[i] for i in range(len(prompts))]


def fresh_engine_greedy(args: Any, prompts: list[list[int]], max_new_tokens: int,
                        ) -> tuple[list[list[int]], list[list[float]]]:
    """greedy_outputs of an engine built from resolved ServerArgs `args`, closed after; on CUDA
    its memory goes back before the next engine sizes its pool."""
    from milepost.engine.setup import build_engine

    engine = build_engine(args)[0]
    try:
        return greedy_outputs(engine, prompts, max_new_tokens)
    finally:
        engine.close()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
