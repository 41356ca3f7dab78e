"""benchmarks/host_samples.py: py-spy's raw stacks summed per function, one thread and one timed
part kept, own time to the innermost frame and inclusive time once per stack."""

from __future__ import annotations

from benchmarks.host_samples import summarize

RAW = """\
thread (11): milepost-engine;Thread.run (/usr/lib/python3.12/threading.py:982);_step (/x/milepost/engine/stepping.py:50);forward (/x/milepost/engine/runner.py:98) 30
thread (11): milepost-engine;Thread.run (/usr/lib/python3.12/threading.py:982);_step (/x/milepost/engine/stepping.py:61);propose (/x/milepost/engine/draft_ngram.py:87);propose (/x/milepost/engine/draft_ngram.py:90) 10
thread (11): milepost-engine;Thread.run (/usr/lib/python3.12/threading.py:982);build (/x/milepost/engine/setup.py:5) 50
thread (12): MainThread;<module> (run.py:3) 99
not a sample line
"""


def test_one_thread_is_summed_per_function() -> None:
    total, own, incl = summarize(RAW.splitlines(), "milepost-engine")
    assert total == 90
    assert own["forward (milepost/engine/runner.py)"] == 30
    assert own["propose (milepost/engine/draft_ngram.py)"] == 10
    # a recursive frame counts once in inclusive time; lines of a function merge into it
    assert incl["propose (milepost/engine/draft_ngram.py)"] == 10
    assert incl["_step (milepost/engine/stepping.py)"] == 40
    assert "<module> (run.py)" not in incl


def test_within_keeps_only_the_timed_part() -> None:
    total, own, _ = summarize(RAW.splitlines(), "milepost-engine", within="_step")
    assert total == 40 and "build (milepost/engine/setup.py)" not in own
