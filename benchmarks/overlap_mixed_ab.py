"""Mixed steps launched ahead by the overlap schedule, against only all-decode steps (as before).

    PYTHONPATH=$PWD python benchmarks/overlap_mixed_ab.py [--shape qwen3-0.6b] [--reps 2]

One engine (random weights, bf16 on CUDA, the engine's defaults: overlap schedule on there), the
workloads where steps with prompt chunks come all the time:
- `multiturn`: 32 sessions x 8 turns (128-token first prompt, 64-token user turns, 256 new
  tokens a turn): each turn is submitted when the previous one ends, beside 31 decoding sessions;
- `queued`: 1024 requests of the mixed scenario's random lengths (100..1024) with at most 256
  running, so a request is admitted from the queue whenever one ends;
- `fixed`: benchmark (a), 256 x 128 -> 256 (mixed steps only while the prompts go in).
Each runs with `Stepper.overlap_mixed` on and off in turn (`--reps` times each, a warm-up of the
same shapes first) and prints tok/s, the ratio of medians, and each run's step timeline.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.switch_ab import alternate, started_engine
from milepost.bench import workloads
from milepost.bench.engine_side import EngineBench
from milepost.bench.timeline import format_summary
from milepost.engine.stepping import Stepper


def scenarios(vocab: int, small: bool) -> dict[str, callable]:
    """name -> a fresh workload (multiturn workloads are filled in as they run)."""
    s = 4 if small else 1  # CPU: a check that the script runs
    return {
        "multiturn": lambda: workloads.multiturn(32 // s, 8 // s, 128, 64, 256 // s, vocab, 0),
        "queued": lambda: workloads.mixed(1024 // s ** 2, 100 // s, 1024 // s ** 2, vocab, 0),
        "fixed": lambda: workloads.fixed(256 // s, 128, 256 // s, vocab, 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scenarios", default="multiturn,queued,fixed")
    a = ap.parse_args()
    engine, native = started_engine(a.shape, overlap_schedule="on")
    bench = EngineBench(engine, 1.0, timeline=True)
    make = scenarios(native.vocab_size, small=not torch.cuda.is_available())
    try:
        for name in a.scenarios.split(","):
            bench.run(make[name]())  # warm-up: the same shapes compiled and captured

            def run(mixed: bool, rep: int, name: str = name) -> float:
                Stepper.overlap_mixed = mixed
                t0 = time.perf_counter()
                r = bench.run(make[name]())
                tag = f"{name}, mixed steps {'ahead' if mixed else 'not ahead'}, run {rep + 1}"
                print(f"== {tag}: {r.output_tokens / r.seconds:,.0f} tok/s, {r.output_tokens} tokens "
                      f"in {r.seconds:.3f} s ({time.perf_counter() - t0:.1f} s with checks)", flush=True)
                print("\n".join(format_summary(tag, r.timeline)), flush=True)
                return r.output_tokens / r.seconds

            on, off = alternate(a.reps, run)
            print(f"## {a.shape} {name}: mixed steps ahead {on:,.0f} tok/s vs not ahead {off:,.0f} "
                  f"(x{on / off:.3f}, medians of {a.reps})", flush=True)
    finally:
        Stepper.overlap_mixed = True
        engine.close()


if __name__ == "__main__":
    main()
