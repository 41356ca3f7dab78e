"""Runs a workload through milepost's `Engine` in-process (no HTTP), timing it end to end.

All requests of a single-turn workload are submitted at once (the engine batches them
continuously); multiturn sessions run concurrently, each submitting its next turn when the
previous one finishes. Decode-step figures come from the engine's own counters (EngineStats).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from milepost.bench.timeline import summarize
from milepost.bench.workloads import Workload
from milepost.engine.engine import Engine
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams


@dataclass
class EngineResult:
    seconds: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    later_turn_prompt_tokens: int  # multiturn: prompts of turns 2.. (what the cache can serve)
    later_turn_cached_tokens: int
    decode_steps: int
    decode_seconds: float
    decode_kv_tokens: int
    decode_batch_sizes: Counter
    speculative: dict | None = None  # acceptance counters of a speculative run (bench/engine.py)
    timeline: dict | None = None  # --timeline: timeline.summarize of the run's steps
    stalls: dict | None = None  # stalls.summarize_stalls of the run (bench/engine.py)


class EngineBench:
    def __init__(self, engine: Engine, temperature: float, timeline: bool = False,
                 top_p: float = 1.0) -> None:
        self.engine = engine
        self.temperature = temperature
        self.top_p = top_p
        self.timeline = timeline  # record every step of each run (EngineStats.timeline)

    def run(self, w: Workload) -> EngineResult:
        """Run every request of `w` (multiturn: fills in w.prompts turn by turn)."""
        engine = self.engine
        if not engine.call(engine.flush_cache).result():
            raise RuntimeError("the engine still has requests from an earlier run")
        before = engine.call(lambda: _decode_counters(engine)).result()
        done = threading.Event()
        lock = threading.Lock()
        outputs: dict[int, list[int]] = {}
        cached: dict[int, int] = {}
        failures: list[str] = []
        left = [len(w.output_lens)]

        def submit(i: int) -> None:
            params = SamplingParams(max_new_tokens=w.output_lens[i], temperature=self.temperature,
                                    top_p=self.top_p, ignore_eos=True)
            outputs[i] = []
            engine.submit(Request(rid=f"{w.name}-{i}", prompt_ids=w.prompts[i], params=params,
                                  on_output=lambda out: on_output(i, out), stop_ids=frozenset()))

        def on_output(i: int, out: RequestOutput) -> None:
            outputs[i].extend(out.new_token_ids)
            if not out.finished:
                return
            if (out.finish_reason or {}).get("type") != "length":
                failures.append(f"request {i}: {out.finish_reason}")
            cached[i] = out.cached_tokens
            if w.turns > 1 and (i + 1) % w.turns != 0:  # next turn of this session
                w.prompts[i + 1] = w.prompts[i] + outputs[i] + w.user_msgs[i + 1]
                submit(i + 1)
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        _sync(engine)
        steps: list = []
        if self.timeline:  # the engine is idle here: it sees the list from its next step on
            engine.stats.timeline = steps
        t0 = time.perf_counter()
        for i in range(0, len(w.output_lens), w.turns):
            submit(i)
        done.wait()
        _sync(engine)
        t1 = time.perf_counter()
        seconds = t1 - t0
        engine.stats.timeline = None
        if failures:
            raise RuntimeError(f"{w.name}: {len(failures)} requests did not finish: {failures[0]}")
        after = engine.call(lambda: _decode_counters(engine)).result()
        later = [i for i in range(len(w.output_lens)) if i % w.turns != 0]
        return EngineResult(
            seconds=seconds,
            prompt_tokens=sum(len(p) for p in w.prompts),
            output_tokens=sum(len(o) for o in outputs.values()),
            cached_tokens=sum(cached.values()),
            later_turn_prompt_tokens=sum(len(w.prompts[i]) for i in later),
            later_turn_cached_tokens=sum(cached[i] for i in later),
            decode_steps=after[0] - before[0],
            decode_seconds=after[1] - before[1],
            decode_kv_tokens=after[2] - before[2],
            decode_batch_sizes=after[3] - before[3],
            timeline=summarize(steps, t0, t1) if self.timeline else None,
        )


def _decode_counters(engine: Engine) -> tuple[int, float, int, Counter]:
    s = engine.stats
    return s.decode_steps, s.decode_seconds, s.decode_kv_tokens, Counter(s.decode_batch_sizes)


def _sync(engine: Engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
