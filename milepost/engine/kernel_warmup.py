"""What an engine does once at start so that serving is not stalled later (`start_engine`):
compile the kernels that steps of every size will need (CUDA; `--skip-kernel-warmup` turns it
off), and take the start-up heap out of Python's full garbage collections.

Several kernels choose their tiles by the step's token count (the fused MoE kernels of
kernels/fused_moe*.py by buckets up to 4096 tokens, the FP8 and INT4 GEMMs by M), and Triton
compiles each tile choice, and each class of integer argument (1, divisible by 16, other), on its
first launch: ~0.3-1 s each. Which counts the steps have depends on how requests arrive, so
without a warm-up a request could wait out a compile in the middle of serving (session 22: one
token of the 30B-A3B benchmark waited 902 ms, that run measured 9.7k tok/s against 11.8k in the
next; session 23's fresh-cache runs, with and without this, compiled nothing while timed). Decode steps are covered by the CUDA graph capture; this runs one prefill step of
each size in `warmup_sizes`, then forgets it: the prefix cache is flushed and the counters reset.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

import torch

from milepost.engine.engine import Engine
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.stats import EngineStats

log = logging.getLogger(__name__)


def start_engine(engine: Engine, kernel_warmup: bool = True) -> None:
    """Start the engine thread, warm up its kernels, then freeze the heap built so far.

    Importing torch and transformers and building the model leave ~400k objects that every full
    collection scanned: 0.29-0.36 s each on the H200 machine, with every engine step waiting
    (one such pause in each 2 s n-gram run of `milepost bench engine`, its stall report). Frozen
    (gc.freeze, after one last collection), they are never scanned again; what serving allocates
    is collected as before."""
    engine.start()
    if kernel_warmup:
        warm_up_kernels(engine)
    gc.collect()
    gc.freeze()


def warmup_sizes(largest: int) -> list[int]:
    """Step sizes that reach every tile bucket (their bounds are powers of two) and every integer
    class: 1, 3 (odd), each power of two up to `largest`, and `largest` itself."""
    sizes = {1, 3, largest}
    size = 2
    while size < largest:
        sizes.add(size)
        size *= 2
    return sorted(s for s in sizes if 1 <= s <= largest)


def warm_up_kernels(engine: Engine, timeout_s: float = 600.0) -> float:
    """Run one prefill of each warmup_sizes length through the started engine, one at a time (so
    each is one step of exactly that many tokens), sampling one token each. Returns the seconds
    it took; 0 on CPU, where nothing compiles."""
    if engine.runner.device.type != "cuda":
        return 0.0
    return run_warmup_steps(engine, timeout_s)


def run_warmup_steps(engine: Engine, timeout_s: float = 600.0) -> float:
    """warm_up_kernels' steps on any device (tests run them on CPU)."""
    runner, cfg = engine.runner, engine.cfg
    # a prompt must fit the context (one token is sampled) and the KV pool
    largest = min(cfg.chunked_prefill_size, cfg.context_length - 1,
                  (cfg.num_blocks - 1) * cfg.block_size - 1)
    t0 = time.perf_counter()
    tokens = torch.Generator().manual_seed(0)
    vocab = runner.model.vocab_size
    for n in warmup_sizes(largest):
        prompt = torch.randint(0, vocab, (n,), generator=tokens).tolist()
        _generate_one(engine, f"kernel-warmup-{n}", prompt, timeout_s)
    if not engine.call(engine.flush_cache).result(timeout=timeout_s):
        raise RuntimeError("kernel warm-up: the engine still held requests after its warm-up")
    engine.call(lambda: _reset_counters(engine)).result(timeout=timeout_s)
    seconds = time.perf_counter() - t0
    log.info("kernel warm-up: prefill steps of %s tokens in %.1f s", warmup_sizes(largest), seconds)
    return seconds


def _generate_one(engine: Engine, rid: str, prompt: list[int], timeout_s: float) -> None:
    done = threading.Event()
    finish: list[dict | None] = []

    def on_output(out: RequestOutput) -> None:
        if out.finished:
            finish.append(out.finish_reason)
            done.set()

    params = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True)
    engine.submit(Request(rid=rid, prompt_ids=prompt, params=params, on_output=on_output,
                          stop_ids=frozenset()))
    if not done.wait(timeout_s):
        raise RuntimeError(f"kernel warm-up: a prefill of {len(prompt)} tokens did not finish in "
                           f"{timeout_s:.0f} s (pass --skip-kernel-warmup to start without it)")
    if engine.error is not None:
        raise RuntimeError("kernel warm-up: the engine failed") from engine.error
    if (finish[0] or {}).get("type") != "length":
        raise RuntimeError(f"kernel warm-up: a prefill of {len(prompt)} tokens ended with "
                           f"{finish[0]} (pass --skip-kernel-warmup to start without it)")


def _reset_counters(engine: Engine) -> None:
    """Served traffic starts from zero: the warm-up's steps and tokens are not counted."""
    timeline = engine.stats.timeline
    engine.stats = EngineStats()
    engine.stats.timeline = timeline
