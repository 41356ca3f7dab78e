"""The step timeline of `milepost bench engine --timeline`: records, kinds, sums, latency percentiles."""

from __future__ import annotations

from types import SimpleNamespace

from milepost.bench.timeline import format_summary, summarize
from milepost.engine.stats import EngineStats, StepRecord


def test_engine_stats_records_steps_only_when_asked() -> None:
    stats = EngineStats()
    chunk = SimpleNamespace(length=1, start=9)
    stats.record_step([chunk], 1, 0.01)
    assert stats.timeline is None
    stats.timeline = []
    stats.record_step([chunk, SimpleNamespace(length=30, start=0)], 2, 0.02)
    stats.record_step([], 0, 0.0)
    (mixed, empty) = stats.timeline
    assert (mixed.chunks, mixed.tokens, mixed.decodes, mixed.kind) == (2, 31, 1, "mixed")
    assert abs((mixed.end - mixed.start) - 0.02) < 1e-9
    assert empty.kind == "empty"


def test_summarize_splits_kinds_gaps_and_weights_latency_by_decode_rows() -> None:
    steps = [StepRecord(0.010, 0.030, 4, 512, 0),  # prefill
             StepRecord(0.031, 0.081, 5, 300, 2),  # mixed: 50 ms seen by 2 decode rows
             StepRecord(0.082, 0.092, 6, 6, 6),  # decode: 10 ms seen by 6 rows
             StepRecord(0.093, 0.103, 6, 6, 6),
             StepRecord(0.104, 0.104, 0, 0, 0)]  # nothing scheduled: not a step of the run
    s = summarize(steps, 0.0, 0.110)
    assert s["steps"] == 4
    assert (s["prefill"]["steps"], s["mixed"]["steps"], s["decode"]["steps"]) == (1, 1, 2)
    assert abs(s["decode"]["seconds"] - 0.020) < 1e-9 and s["decode"]["tokens"] == 12
    assert abs(s["before_first_step_s"] - 0.010) < 1e-9
    assert abs(s["between_steps_s"] - 0.003) < 1e-9
    assert abs(s["after_last_step_s"] - 0.007) < 1e-9
    itl = s["itl_ms"]  # 14 decode rows: 12 saw 10 ms, 2 saw 50 ms
    assert abs(itl["p50"] - 10) < 1e-6 and abs(itl["p90"] - 50) < 1e-6 and abs(itl["max"] - 50) < 1e-6
    text = "\n".join(format_summary("fixed", s))
    assert "mixed" in text and "p99 50.00" in text
