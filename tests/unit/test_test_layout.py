"""The suite's layout: test modules are imported by basename (no __init__.py in tests/), so two
files with one basename in tests/unit and tests/e2e break collection of the whole suite in a
clean clone. Caught here, in the fast unit run, instead of at CI's collection step."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    clashes = sorted(n for n, c in names.items() if c > 1)
    assert not clashes, (f"test modules sharing a basename (rename the e2e one *_live.py): {clashes}")
