"""Host cost of n-gram proposals at a large batch (issue 27): `NgramDrafter.propose` for every
request of a decode step, as the engine calls it, on benchmark (a)'s n8 workload (8 samples of each
prompt, random tokens, one new token per request per step). Prints, per scope, the first step
(each request's prompt indexed) and the mean of the later steps: time the engine's step spends on
the host before its forward when speculation is on.

Usage: python benchmarks/ngram_propose_cost.py [--requests 256] [--prompt-len 128] [--output-len 256]

`--turns T` runs a conversation per request instead (`--n-samples-per-prompt 1` is implied): each
turn's prompt is the last turn's text and `--turn-user-len` new tokens, and the first step of
every turn is printed (where a turn's history gets indexed; request scope carries a finished
turn's index into the next one).
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


def measure_turns(scope: str, requests: int, prompt_len: int, output_len: int, turns: int,
                  user_len: int, k: int, vocab: int, seed: int) -> list[float]:
    """Each turn's first step (seconds): `requests` conversations of `turns` turns."""
    rng = random.Random(seed)
    texts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]
    drafter = NgramDrafter(2, 8, scope)  # type: ignore[arg-type]
    firsts = []
    for _ in range(turns):
        reqs = [_Req(t) for t in texts]
        for step in range(output_len):
            t0 = time.perf_counter()
            for r in reqs:
                drafter.propose(r, k)  # type: ignore[arg-type]
            if step == 0:
                firsts.append(time.perf_counter() - t0)
            for r in reqs:
                r.output_ids.append(rng.randrange(vocab))
        for r in reqs:
            drafter.record_finished(r)  # type: ignore[arg-type]
        texts = [r.prompt_ids + r.output_ids + [rng.randrange(vocab) for _ in range(user_len)]
                 for r in reqs]
    return firsts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--n-samples-per-prompt", type=int, default=8)
    ap.add_argument("--draft-tokens", type=int, default=4, help="proposals asked per request")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--turn-user-len", type=int, default=64)
    a = ap.parse_args()
    if a.turns > 1:
        for scope in SCOPES:
            firsts = measure_turns(scope, a.requests, a.prompt_len, a.output_len, a.turns,
                                   a.turn_user_len, a.draft_tokens, a.vocab, a.seed)
            print(f"{scope:>8} scope, {a.requests} conversations: each turn's first step "
                  + ", ".join(f"{t * 1e3:.1f}" for t in firsts) + " ms", flush=True)
        return
    for scope in SCOPES:
        first, later = measure(scope, a.requests, a.prompt_len, a.output_len, a.n_samples_per_prompt,
                               a.draft_tokens, a.vocab, a.seed)
        print(f"{scope:>8} scope, {a.requests} requests: first step {first * 1e3:.1f} ms, "
              f"later steps {later * 1e3:.2f} ms each")


if __name__ == "__main__":
    main()
