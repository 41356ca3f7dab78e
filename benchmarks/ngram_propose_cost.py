"""Host cost of n-gram proposals at a large batch (issue 27): `NgramDrafter.propose` for every
request of a decode step, as the engine calls it, on benchmark (a)'s n8 workload (8 samples of each
prompt, random tokens, one new token per request per step). Prints, per scope, the first step
(each request's prompt indexed) and the mean of the later steps: time the engine's step spends on
the host before its forward when speculation is on.

Usage: python benchmarks/ngram_propose_cost.py [--requests 256] [--prompt-len 128] [--output-len 256]
"""

from __future__ import annotations

import argparse
import random
import time

from milepost.engine.draft_ngram import SCOPES, NgramDrafter


class _Req:
    """What `propose` reads of a request: its prompt and output ids (and a weak reference)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []


def measure(scope: str, requests: int, prompt_len: int, output_len: int, samples: int,
            k: int, vocab: int, seed: int) -> tuple[float, float]:
    """(first step, mean later step) in seconds."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)]
               for _ in range(-(-requests // samples))]
    reqs = [_Req(prompts[i // samples]) for i in range(requests)]
    drafter = NgramDrafter(2, 8, scope)  # type: ignore[arg-type]  # the engine's default windows
    steps = []
    for _ in range(output_len):
        t0 = time.perf_counter()
        for r in reqs:
            drafter.propose(r, k)  # type: ignore[arg-type]
        steps.append(time.perf_counter() - t0)
        for r in reqs:
            r.output_ids.append(rng.randrange(vocab))
    return steps[0], sum(steps[1:]) / max(1, len(steps) - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--n-samples-per-prompt", type=int, default=8)
    ap.add_argument("--draft-tokens", type=int, default=4, help="proposals asked per request")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    for scope in SCOPES:
        first, later = measure(scope, a.requests, a.prompt_len, a.output_len, a.n_samples_per_prompt,
                               a.draft_tokens, a.vocab, a.seed)
        print(f"{scope:>8} scope, {a.requests} requests: first step {first * 1e3:.1f} ms, "
              f"later steps {later * 1e3:.2f} ms each")


if __name__ == "__main__":
    main()
