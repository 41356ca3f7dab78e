"""When the n-gram speculator rests: its proposals found nothing, or speculating measured slower.

A resting step is a plain decode step, launched ahead by the overlap schedule (stepping.py):
exact as ever. A speculative step cannot be launched ahead (its proposals need the last tokens on
the host), so it pays its host work in full, and its verify forward reads four rows a request.
Whether that buys tokens depends on the acceptance, the batch and the machine: on an H100 the 0.6B
shape at 16 requests ran 0.78x plain decoding at acceptance length 3 (benchmarks/RESULTS.md). So
the pace measures both: tokens a second of each speculative step (from its scheduling, after any
queued plain step was applied, to the next step's start), and of each run of resting steps (from
the second one's start until their results are applied: the first starts with nothing queued
ahead of it, so it pays its host work in full, which the overlap schedule hides for the others;
counted, it made plain decoding look slower than it is, and speculation kept on while it lost).
While speculating is slower, it rests for 1, 2, 4, ... MAX_REST steps (doubling while the probes
between rests still lose; back to none once one wins); with no plain rate yet, or none for REFRESH
speculative steps, it rests PROBE steps to measure one. Steps that proposed nothing rest the same
way (the first back-off, session 21).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RestPace:
    MAX_REST = 16
    PROBE = 4  # plain steps that measure plain decoding's rate
    REFRESH = 64  # speculative steps after which plain decoding is measured again
    EMA = 0.25  # weight of the newest speculative step's rate

    def __init__(self, measured: bool, clock: Callable[[], float] = time.perf_counter) -> None:
        """measured: also rest while speculative steps are measured slower than plain ones."""
        self.measured = measured
        self.clock = clock
        self.rest = 0  # steps left to rest
        self.backoff = 0  # the last rest's length (0: the last probe won)
        self.spec_rate: float | None = None  # tokens a second, EMA over speculative steps
        self.plain_rate: float | None = None  # tokens a second of the last run of resting steps
        self.slower_rests = 0  # rests begun because speculating measured slower
        self._since_plain = 0  # speculative steps since plain decoding was last measured
        self._spec: tuple[float, int] | None = None  # the open speculative step: (start, tokens)
        self._run_steps = 0  # resting steps in the open run (0: no run open)
        self._run_start = 0.0  # the open run's second step's start
        self._run_tokens = 0  # tokens of the open run's steps from the second on

    def resting(self) -> bool:
        return self.rest > 0

    def scheduled(self) -> None:
        """A step is about to be scheduled, every queued step applied: close a run of resting
        steps (their tokens are all on the host now)."""
        if self._run_steps and not self.resting():
            tokens = self._run_tokens
            self._run_steps = self._run_tokens = 0
            seconds = self.clock() - self._run_start
            if seconds > 0 and tokens:
                rate = tokens / seconds
                self.plain_rate = rate if self.plain_rate is None else (self.plain_rate + rate) / 2
                self._since_plain = 0

    def rested(self, start: float, tokens: int) -> None:
        """A resting step that began at `start` sampled `tokens` tokens (the first of a run is
        not timed: it fills the overlap schedule's pipeline)."""
        self.rest -= 1
        self._run_steps += 1
        if self._run_steps == 2:
            self._run_start = start
        if self._run_steps >= 2:
            self._run_tokens += tokens

    def verified(self, start: float, tokens: int) -> None:
        """A speculative step scheduled at `start` appended `tokens`; timed at the next step."""
        self._spec = (start, tokens)

    def step_begins(self) -> None:
        """Before the next step: time the speculative step just done and decide whether to rest."""
        if self._spec is None:
            return
        start, tokens = self._spec
        self._spec = None
        seconds = self.clock() - start
        if seconds <= 0:
            return
        rate = tokens / seconds
        self.spec_rate = rate if self.spec_rate is None else (
            self.EMA * rate + (1 - self.EMA) * self.spec_rate)
        if not self.measured:
            return
        self._since_plain += 1
        if self.plain_rate is None or self._since_plain >= self.REFRESH:
            self.rest = max(self.rest, self.PROBE)
        elif self.spec_rate < self.plain_rate:
            self.slower_rests += 1
            self._back_off()
        else:
            self.backoff = 0

    def proposed(self, anything: bool) -> None:
        """A step's proposals were made: none at all rests (doubling), some reset the back-off
        unless the measured rates say otherwise (step_begins)."""
        if not anything:
            self._back_off()
        elif not self.measured or self.plain_rate is None or self.spec_rate is None \
                or self.spec_rate >= self.plain_rate:
            self.backoff = 0

    def _back_off(self) -> None:
        self.backoff = min(self.MAX_REST, max(1, 2 * self.backoff))
        self.rest = self.backoff
