"""tests/module_seconds.json's source (the order xdist workers take modules in, tests/conftest.py):
per-module times summed from a JUnit report, longest first."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.testing.module_seconds import module_seconds

ROOT = Path(__file__).resolve().parents[2]

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.unit.test_module_seconds" name="test_a" time="1.5" />
<testcase classname="tests.unit.test_module_seconds" name="test_b[x]" time="2.0" />
<testcase classname="tests.e2e.conftest" name="test_c" time="30" />
<testcase classname="tests.unit.test_demo_build" name="test_d" time="0.2" />
</testsuite></testsuites>"""


def test_times_are_summed_per_module_longest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # module paths are checked against the checkout
    xml = tmp_path / "r.xml"
    xml.write_text(REPORT)
    assert module_seconds(xml) == {"tests/e2e/conftest.py": 30.0, "tests/unit/test_module_seconds.py": 3.5,
                                   "tests/unit/test_demo_build.py": 0.2}
    assert list(module_seconds(xml, min_seconds=1.0)) == ["tests/e2e/conftest.py",
                                                         "tests/unit/test_module_seconds.py"]
