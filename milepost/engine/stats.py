"""Engine counters: throughput, prefix-cache hit rate, queue depths; rendered for Prometheus.

Counters are plain numbers owned by the engine thread; readers on other threads take a
snapshot, which is consistent enough for monitoring (each value is a single Python object).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from milepost.engine.request import Request


@dataclass(frozen=True)
class StepRecord:
    """One engine step as the timeline sees it (perf_counter seconds, host-timed)."""

    start: float
    end: float
    chunks: int
    tokens: int  # tokens computed (prefill chunk lengths + one per decode)
    decodes: int  # one-token chunks: the rows that wait this step for their next token

    @property
    def kind(self) -> str:
        """decode (every chunk one token), prefill (none), mixed, or empty (nothing scheduled)."""
        if self.chunks == 0:
            return "empty"
        if self.decodes == self.chunks:
            return "decode"
        return "prefill" if self.decodes == 0 else "mixed"


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    computed_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    busy_seconds: float = 0.0
    # Steps that only decoded (every chunk one token): what the bandwidth bound is about.
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_kv_tokens: int = 0  # KV entries the decode steps attended over, summed
    decode_batch_sizes: Counter = field(default_factory=Counter)  # rows per decode step -> steps
    _recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens sampled)
    # When a list: one StepRecord per step (`milepost bench engine --timeline`); None = off.
    timeline: list | None = None

    def record_step(self, chunks: list, n_sampled: int, seconds: float) -> None:
        if self.timeline is not None:
            end = time.perf_counter()
            decodes = sum(1 for c in chunks if c.length == 1)
            self.timeline.append(StepRecord(end - seconds, end, len(chunks),
                                            sum(c.length for c in chunks), decodes))
        self.steps += 1
        self.generated_tokens += n_sampled
        self.computed_tokens += sum(c.length for c in chunks)
        self.busy_seconds += seconds
        self._recent.append((time.monotonic(), n_sampled))
        if chunks and all(c.length == 1 for c in chunks):
            self.decode_steps += 1
            self.decode_seconds += seconds
            self.decode_kv_tokens += sum(c.start + 1 for c in chunks)
            self.decode_batch_sizes[len(chunks)] += 1

    def record_finish(self, req: Request) -> None:
        self.finished_requests += 1
        if req.finish_reason and req.finish_reason.get("type") == "abort":
            self.aborted_requests += 1
        if req.admitted_once:
            self.prompt_tokens += len(req.prompt_ids)
            self.cached_tokens += req.cached_tokens

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def generation_throughput(self, window_s: float = 10.0) -> float:
        """Sampled tokens per second over the last window_s seconds of steps."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window_s]
        if len(recent) < 2:
            return 0.0
        span = max(recent[-1][0] - recent[0][0], 1e-6)
        return sum(n for _, n in recent[1:]) / span


def prometheus_text(stats: EngineStats, gauges: dict[str, float]) -> bytes:
    """Prometheus exposition of the counters plus the engine's current gauges."""
    counters = {
        "prompt_tokens": (stats.prompt_tokens, "Prompt tokens admitted."),
        "cached_tokens": (stats.cached_tokens, "Prompt tokens served from the prefix cache."),
        "generation_tokens": (stats.generated_tokens, "Tokens sampled."),
        "requests_finished": (stats.finished_requests, "Requests finished (any reason)."),
        "requests_aborted": (stats.aborted_requests, "Requests aborted."),
        "forward_steps": (stats.steps, "Engine forward passes."),
    }
    all_gauges = {
        "cache_hit_rate": stats.cache_hit_rate,
        "gen_throughput": stats.generation_throughput(),
        **gauges,
    }

    class _Collector(Collector):
        def collect(self):  # noqa: ANN202 - prometheus_client's interface
            for name, (value, doc) in counters.items():
                yield CounterMetricFamily(f"milepost:{name}", doc, value=value)
            for name, value in all_gauges.items():
                yield GaugeMetricFamily(f"milepost:{name}", name.replace("_", " "), value=value)

    registry = CollectorRegistry()
    registry.register(_Collector())
    return generate_latest(registry)
