"""Mixed steps launched ahead by the overlap schedule, against only all-decode steps (as before).

    python benchmarks/overlap_mixed_ab.py [--shape qwen3-0.6b] [--reps 2]

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
import statistics
import time

import torch

from milepost.bench import workloads
from milepost.bench.engine_side import EngineBench
from milepost.bench.models import native_model
from milepost.bench.timeline import format_summary
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
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
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    native, cfg_dir = native_model(None, a.shape, torch.bfloat16 if cuda else torch.float32, dev, 0)
    args = ServerArgs(model_path=cfg_dir, device=dev.type, dtype="bfloat16" if cuda else "float32",
                      max_running_requests=256 if cuda else 16, overlap_schedule="on",
                      random_seed=0).resolved()
    engine = build_engine(args, model=native)[0]
    engine.start()
    bench = EngineBench(engine, 1.0, timeline=True)
    make = scenarios(native.vocab_size, small=not cuda)
    try:
        for name in a.scenarios.split(","):
            bench.run(make[name]())  # warm-up: the same shapes compiled and captured
            tok_s: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(a.reps):
                for mixed in (True, False) if rep % 2 == 0 else (False, True):
                    Stepper.overlap_mixed = mixed
                    t0 = time.perf_counter()
                    r = bench.run(make[name]())
                    tok_s[mixed].append(r.output_tokens / r.seconds)
                    tag = f"{name}, mixed steps {'ahead' if mixed else 'not ahead'}, run {rep + 1}"
                    print(f"== {tag}: {tok_s[mixed][-1]:,.0f} tok/s, {r.output_tokens} tokens in "
                          f"{r.seconds:.3f} s ({time.perf_counter() - t0:.1f} s with checks)",
                          flush=True)
                    print("\n".join(format_summary(tag, r.timeline)), flush=True)
            on, off = statistics.median(tok_s[True]), statistics.median(tok_s[False])
            print(f"## {a.shape} {name}: mixed steps ahead {on:,.0f} tok/s vs not ahead {off:,.0f} "
                  f"(x{on / off:.3f}, medians of {a.reps})", flush=True)
    finally:
        Stepper.overlap_mixed = True
        engine.close()


if __name__ == "__main__":
    main()
