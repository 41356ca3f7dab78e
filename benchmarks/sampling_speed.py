"""The fast batched sampler vs the former row-by-row one, in one run, at Qwen3's vocabulary.

Each scenario samples a batch of `--batch` rows of random fp32 logits over `--vocab` tokens with
both samplers (same logits, same seeds; the test suite checks that they draw the same tokens) and
prints the median time per call of each and the ratio. Run: `python benchmarks/sampling_speed.py`
(add `--device cuda` on the GPU machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from milepost.engine.sampling import SamplingParams, sample
from milepost.testing.reference_sampling import reference_sample

SCENARIOS: dict[str, Callable[[int], list[SamplingParams]]] = {
    "temperature 1 (RL default)": lambda b: [SamplingParams(temperature=1.0)] * b,
    "greedy": lambda b: [SamplingParams(temperature=0.0)] * b,
    "top_k 50": lambda b: [SamplingParams(temperature=0.8, top_k=50)] * b,
    "top_p 0.9": lambda b: [SamplingParams(temperature=0.8, top_p=0.9)] * b,
    "mixed (1/4 each)": lambda b: [
        [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
         SamplingParams(temperature=0.7, top_k=20), SamplingParams(top_p=0.95, min_p=0.01)][i % 4]
        for i in range(b)
    ],
}


def _time(fn: Callable[[], object], reps: int, device: str) -> float:
    times = []
    for _ in range(reps + 1):  # the first call warms up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--logprobs", type=int, default=0, help="top_logprobs_num for every call")
    a = p.parse_args()
    g = torch.Generator(device=a.device).manual_seed(0)
    logits = torch.randn(a.batch, a.vocab, generator=g, device=a.device) * 3.0
    print(f"vocab={a.vocab} batch={a.batch} device={a.device} threads={torch.get_num_threads()} "
          f"top_logprobs_num={a.logprobs}")
    print(f"{'scenario':28s} {'row-by-row':>12s} {'batched':>12s} {'speedup':>8s}")
    for name, make in SCENARIOS.items():
        params = make(a.batch)
        gens = [torch.Generator(device=a.device).manual_seed(1)] * a.batch
        banned: list[list[int]] = [[]] * a.batch
        old = _time(lambda: reference_sample(logits, params, gens, banned, a.logprobs), a.reps,
                    a.device)
        new = _time(lambda: sample(logits, params, gens, banned, a.logprobs), a.reps, a.device)
        print(f"{name:28s} {old * 1e3:10.1f}ms {new * 1e3:10.1f}ms {old / new:7.2f}x")


if __name__ == "__main__":
    main()
