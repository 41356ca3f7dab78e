"""Where a speculative step's time goes: the engine loop under cProfile, speculative and plain.

    python benchmarks/speculative_step_profile.py [--shape qwen3-0.6b] [--requests 16]
        [--output-len 256] [--device cuda] [--only plain|ngram] [--no-cprofile]

With `--no-cprofile` the timed run is only timed (in `timed_run`), for a sampling profiler
outside the process (cProfile's tracing doubles the host's Python costs):

    py-spy record --idle --threads -r 2000 -f raw -o host.txt -- python \
        benchmarks/speculative_step_profile.py --only ngram --no-cprofile
    python benchmarks/host_samples.py host.txt --thread MainThread --within timed_run

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


def timed_run(engine: object, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """The run a sampling profiler's samples are kept from (host_samples.py --within timed_run)."""
    toks, _ = greedy_outputs(engine, prompts, output_len)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return toks


def profile(shape: str, requests: int, output_len: int, device: str, flags: dict,
            cprofile: bool = True) -> None:
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
        if cprofile:
            prof.enable()
        toks = timed_run(engine, looping(requests, native.vocab_size, 0), output_len)
        if cprofile:
            prof.disable()
        seconds = time.perf_counter() - t0
        steps = engine.stats.steps - steps0
        spec = engine.speculator.stats if engine.speculator is not None else None
        print(f"== {flags or 'plain'}: {sum(map(len, toks))} tokens in {seconds:.3f} s, {steps} steps, "
              f"{1e3 * seconds / max(steps, 1):.2f} ms a step"
              + (" (under cProfile)" if cprofile else "")
              + (f", acceptance length {spec.accept_length:.2f}" if spec else ""), flush=True)
        if not cprofile:
            return
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
    ap.add_argument("--only", choices=("plain", "ngram"), default=None)
    ap.add_argument("--no-cprofile", action="store_true", help="time only (for py-spy outside)")
    a = ap.parse_args()
    runs = {"plain": {}, "ngram": {"speculative_algorithm": "NGRAM", "speculative_ngram_scope": "request"}}
    for name, flags in runs.items():
        if a.only in (None, name):
            profile(a.shape, a.requests, a.output_len, a.device, flags, not a.no_cprofile)


if __name__ == "__main__":
    main()
