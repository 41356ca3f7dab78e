"""Per-module test times from a JUnit XML report, for tests/module_seconds.json (the order in
which pytest-xdist workers take modules, tests/conftest.py):
`python -m milepost.testing.module_seconds report.xml --min-seconds 5 > tests/module_seconds.json`
(after `pytest ... --junitxml=report.xml`).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def module_seconds(junit_xml: Path, min_seconds: float = 0.0) -> dict[str, float]:
    """{"tests/unit/test_x.py": seconds summed over its test cases}, modules under min_seconds
    left out, longest first. JUnit names a case by its dotted module path (`tests.unit.test_x`)."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "")
        if not module:
            continue
        # a test method of a class: tests.unit.test_x.TestY -> the module is the longest prefix
        # that names a file; test modules here are functions, so the class part is rare
        path = module.replace(".", "/") + ".py"
        while not Path(path).exists() and "/" in path[:-3]:
            path = path[:-3].rsplit("/", 1)[0] + ".py"
        totals[path] += float(case.get("time", "0") or 0)
    kept = {m: round(s, 1) for m, s in totals.items() if s >= min_seconds}
    return dict(sorted(kept.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m milepost.testing.module_seconds", description=__doc__)
    ap.add_argument("junit_xml", type=Path)
    ap.add_argument("--min-seconds", type=float, default=5.0)
    ap.add_argument("--note", default="", help="where and how the times were measured")
    args = ap.parse_args(argv)
    out = {"note": args.note, "modules": module_seconds(args.junit_xml, args.min_seconds)}
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
