"""Where a speculative step's time goes: the engine loop under cProfile, speculative and plain.

    python benchmarks/speculative_step_profile.py [--shape qwen3-0.6b] [--requests 16]
        [--output-len 256] [--device cuda]

Greedy, random weights, each prompt a short phrase repeated (so the n-gram lookup has something to
propose), `--speculative-algorithm NGRAM` (request scope) against the plain engine, each after a
warm-up on other prompts. Prints per engine: seconds, steps, ms a step, then the engine's own
functions by cumulative time per step (the `.tolist()` reads are where the host waits for the
GPU). Read it with benchmarks/RESULTS.md's session 28 numbers: a speculative step took ~3.7 ms
on an H100 against a plain step's 1.49.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from milepost.bench import models as bench_models
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.engine_greedy import greedy_outputs


def looping(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (4 + i % 5,), generator=g).tolist() * 24 for i in range(n)]


def profile(shape: str, requests: int, output_len: int, device: str, flags: dict) -> None:
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    native, config_dir = bench_models.native_model(None, shape, dtype, dev, 0)
    args = ServerArgs(model_path=config_dir, device=device, dtype=str(dtype)[6:],
                      max_running_requests=requests, random_seed=0, **flags).resolved()
    engine = build_engine(args, model=native)[0]
    try:
        greedy_outputs(engine, looping(requests, native.vocab_size, 1), 32)  # warm-up
        steps0 = engine.stats.steps
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        toks, _ = greedy_outputs(engine, looping(requests, native.vocab_size, 0), output_len)
        prof.disable()
        seconds = time.perf_counter() - t0
        steps = engine.stats.steps - steps0
        spec = engine.speculator.stats if engine.speculator is not None else None
        print(f"== {flags or 'plain'}: {sum(map(len, toks))} tokens in {seconds:.3f} s, {steps} steps, "
              f"{1e3 * seconds / max(steps, 1):.2f} ms a step (under cProfile)"
              + (f", acceptance length {spec.accept_length:.2f}" if spec else ""), flush=True)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumtime").print_stats(
            r"milepost/engine|tolist|synchronize", 28)
        print(out.getvalue(), flush=True)
    finally:
        engine.close()
        del engine, native
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    for flags in ({}, {"speculative_algorithm": "NGRAM", "speculative_ngram_scope": "request"}):
        profile(a.shape, a.requests, a.output_len, a.device, flags)


if __name__ == "__main__":
    main()
