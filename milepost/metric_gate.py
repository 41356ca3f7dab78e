"""The metric-history gate: a fresh deterministic run's registered metrics against the committed
standard in benchmarks/history/NAME.jsonl (report sections 6 and 8), bit for bit.

    python -m milepost.metric_gate check [NAME ...]   # CI: exit 1 with a readable diff
    python -m milepost.metric_gate update NAME        # rewrite the standard, printing the diff
    python -m milepost.metric_gate list

A standard file is JSON lines: a header (what ran, where, which metrics are registered and how
they compare), then one record per step. A metric is `exact` (floats compared bit for bit: JSON
keeps a float's shortest repr, which round-trips exactly) or held to a `band` (absolute
tolerance, justified in the header by the spread measured across repeated runs).

Bit for bit holds on one kind of processor only: even with torch, MKL and oneDNN held to their AVX2
kernels (gate_runs.PINNED_KERNELS), an AMD EPYC and an Intel Xeon differ from step 0 by ~1e-7
(2026-12-05). So a standard is per CPU vendor: NAME.jsonl (its header's `cpu_vendor`) and
NAME.<vendor>.jsonl beside it. A machine whose vendor has a standard is held to it bit for bit; one
whose vendor has none is held to another vendor's within CROSS_VENDOR (said loudly), and `update`
on it records one. `update` removes the other vendors' standards: they describe the old behaviour.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost.gate_runs import DEFAULT_BANDS, RUNS, GateRun, registrable, run_fresh

HISTORY = Path(__file__).resolve().parents[1] / "benchmarks" / "history"


@dataclass(frozen=True)
class Standard:
    header: dict[str, Any]
    steps: list[dict[str, float]]

    @property
    def exact(self) -> list[str]:
        return list(self.header.get("exact", []))

    @property
    def bands(self) -> dict[str, float]:
        return dict(self.header.get("bands", {}))


@dataclass(frozen=True)
class Difference:
    step: int | None
    metric: str
    standard: Any
    fresh: Any
    allowed: str


# Where no standard of this machine's CPU vendor exists: |fresh - standard| <= ATOL + RTOL * |standard|
# for non-integral floats. The Intel/AMD differences of 2026-12-05 reached 8.3e-7 absolute
# (grad_norm 3.73) and 5e-5 relative (a loss of 1e-3); a code change is what this still catches.
CROSS_VENDOR = (1e-6, 1e-5)


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or the machine's name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "unknown"


def standard_paths(name: str) -> list[Path]:
    """Every vendor's standard for `name`, the primary NAME.jsonl first."""
    return [p for p in [HISTORY / f"{name}.jsonl", *sorted(HISTORY.glob(f"{name}.*.jsonl"))]
            if p.is_file()]


def standard_path(name: str, vendor: str | None = None) -> Path:
    """This vendor's standard for `name` (default this machine's): the primary file where its header
    names the vendor (or no file exists yet), else NAME.<vendor>.jsonl."""
    vendor = vendor or cpu_vendor()
    primary = HISTORY / f"{name}.jsonl"
    if not primary.is_file() or read_standard(primary).header.get("cpu_vendor") == vendor:
        return primary
    return HISTORY / f"{name}.{vendor}.jsonl"


def read_standard(path: Path) -> Standard:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or "standard" not in lines[0]:
        raise ValueError(f"{path}: the first line must be the standard's header")
    return Standard(lines[0], lines[1:])


def write_standard(path: Path, standard: Standard) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in [standard.header, *standard.steps])
    path.write_text(text)


def registered_steps(records: list[dict[str, Any]], names: list[str]) -> list[dict[str, float]]:
    """One record per step holding the step and the registered metrics it logged."""
    return [{"step": r["step"], **{n: r[n] for n in names if n in r}} for r in records]


def compare(standard: Standard, records: list[dict[str, Any]],
            cross_vendor: bool = False) -> list[Difference]:
    """Every way the fresh `records` (metrics.jsonl) differ from `standard`; empty when they agree.
    `cross_vendor`: exact floats that are not integral are held to CROSS_VENDOR instead."""
    fresh = {r["step"]: r for r in records}
    diffs: list[Difference] = []
    if sorted(fresh) != [s["step"] for s in standard.steps]:
        diffs.append(Difference(None, "steps", [s["step"] for s in standard.steps], sorted(fresh),
                                "the same steps"))
    bands = standard.bands
    for want in standard.steps:
        if want["step"] not in fresh:
            continue  # named once, in the steps row
        got = fresh[want["step"]]
        for name, value in want.items():
            if name == "step":
                continue
            if name not in got:
                diffs.append(Difference(want["step"], name, value, "missing", "logged"))
            elif name in bands:
                if not abs(got[name] - value) <= bands[name]:
                    diffs.append(Difference(want["step"], name, value, got[name], f"± {bands[name]:g}"))
            elif cross_vendor and _near(value, got[name]):
                continue
            elif got[name] != value:
                allowed = "another CPU vendor's, ± 1e-6 + 1e-5·|x|" if cross_vendor else "bit for bit"
                diffs.append(Difference(want["step"], name, value, got[name], allowed))
    return diffs


def _near(want: Any, got: Any) -> bool:
    if not (isinstance(want, float) and isinstance(got, float)) or want.is_integer():
        return False
    atol, rtol = CROSS_VENDOR
    return abs(got - want) <= atol + rtol * abs(want)


def format_diff(name: str, diffs: list[Difference], limit: int = 40) -> str:
    """A table a person can read: where the fresh run left its standard, first differences first."""
    rows = [("step", "metric", "standard", "fresh", "difference", "allowed")]
    for d in diffs[:limit]:
        delta = (f"{d.fresh - d.standard:+.3g}" if isinstance(d.fresh, float)
                 and isinstance(d.standard, float) else "")
        rows.append(("-" if d.step is None else str(d.step), d.metric, repr(d.standard),
                     repr(d.fresh), delta, d.allowed))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"metric gate {name!r}: {len(diffs)} difference(s) from {_source(name)}"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if len(diffs) > limit:
        lines.append(f"  ... and {len(diffs) - limit} more")
    first = [d for d in diffs if d.step is not None]
    if first:
        lines.append(f"first differing step: {min(d.step for d in first)}")  # type: ignore[type-var]
    return "\n".join(lines)


def _environment() -> dict[str, str]:
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {_cpu_count()} CPUs, {platform.system()}",
            "cpu_vendor": cpu_vendor()}


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check(run: GateRun, extra_args: list[str] | None = None, work: Path | None = None) -> list[Difference]:
    """Run `run` fresh (plus `extra_args`, e.g. a perturbation) and compare with its standard."""
    path, cross_vendor = _chosen(run.name)
    standard = read_standard(path)
    if cross_vendor:
        print(f"note: no {run.name!r} standard for this CPU vendor ({cpu_vendor()}); holding floats "
              f"to {path.name} ({standard.header.get('cpu_vendor')}) within ± 1e-6 + 1e-5·|x|, not "
              f"bit for bit. `python -m milepost.metric_gate update {run.name}` on this machine "
              "records one (after checking that nothing else changed)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=f"gate-{run.name}-") as tmp:
        records = run_fresh(run, work or Path(tmp), extra_args)
    env = _environment()
    changed = {k: (standard.header.get(k), v) for k, v in env.items() if standard.header.get(k) != v}
    if changed:
        print(f"note: the standard was made with {changed} (standard, here)", file=sys.stderr)
    return compare(standard, records, cross_vendor)


def _source(name: str) -> Path:
    try:
        return _chosen(name)[0]
    except FileNotFoundError:
        return HISTORY / f"{name}.jsonl"


def _chosen(name: str) -> tuple[Path, bool]:
    """The standard a check on this machine uses, and whether it is another vendor's."""
    own = standard_path(name)
    if own.is_file():
        return own, False
    others = standard_paths(name)
    if not others:
        raise FileNotFoundError(f"no standard for {name!r} in {HISTORY}; run "
                                f"`python -m milepost.metric_gate update {name}`")
    return others[0], True


def update(run: GateRun, bands: dict[str, float] | None = None, work: Path | None = None,
           add_vendor: bool = False) -> tuple[Standard, list[Difference]]:
    """A fresh run becomes this CPU vendor's standard (every registrable metric exact unless banded);
    returns it and how it differs from the old one. The other vendors' standards are removed, or with
    `add_vendor` kept: then the fresh run must agree with them within CROSS_VENDOR (the same
    behaviour on another processor), else nothing is written."""
    path = standard_path(run.name)
    others = [p for p in standard_paths(run.name) if p != path]
    old = read_standard(path if path.is_file() else others[0]) if path.is_file() or others else None
    with tempfile.TemporaryDirectory(prefix=f"gate-{run.name}-") as tmp:
        records = run_fresh(run, work or Path(tmp))
    names = sorted({k for r in records for k in r if registrable(k)})
    bands = dict(DEFAULT_BANDS if bands is None else bands)
    header = {"standard": run.name, "description": run.description, "recipe": run.recipe,
              "proxy_of": run.proxy_of, "exact": [n for n in names if n not in bands],
              "bands": {n: bands[n] for n in names if n in bands},
              "date": datetime.date.today().isoformat(), **_environment(),
              "update": f"python -m milepost.metric_gate update {run.name}"}
    new = Standard(header, registered_steps(records, names))
    diffs = compare(old, records, cross_vendor=not path.is_file()) if old else []
    if add_vendor:
        if path.is_file():
            raise SystemExit(f"--add-vendor: {path.name} already holds {cpu_vendor()}'s standard; "
                             "a plain `update` replaces it")
        if diffs:
            raise SystemExit(format_diff(run.name, diffs) + "\n--add-vendor: the fresh run is not "
                             "the behaviour the other vendors' standards hold; nothing written")
        write_standard(path, new)
        return new, diffs
    write_standard(path, new)
    for stale in others:  # another vendor's record of the behaviour this update replaces
        stale.unlink()
        print(f"removed {stale} (another CPU vendor's standard of the old behaviour; record it again "
              "there with `update`)", file=sys.stderr)
    return new, diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m milepost.metric_gate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="fresh runs against their committed standards")
    c.add_argument("names", nargs="*", help="standards to check (default: every one not opt-in)")
    c.add_argument("--train-args", nargs=argparse.REMAINDER, default=[],
                   help="extra `milepost train` flags for the fresh run (a perturbation)")
    u = sub.add_parser("update", help="make a fresh run the standard, printing what changed")
    u.add_argument("name", choices=sorted(RUNS))
    u.add_argument("--add-vendor", action="store_true",
                   help="record this CPU vendor's standard beside the others' (refused unless the "
                   "fresh run agrees with them within the cross-vendor tolerance)")
    for p in (c, u):
        p.add_argument("--work", type=Path, default=None,
                       help="keep the run's inputs and outputs here (reused: e.g. the demo's base "
                       "model); default a temporary directory")
    sub.add_parser("list", help="the standards and what each runs")
    ns = parser.parse_args(argv)
    if ns.cmd == "list":
        for run in RUNS.values():
            vendors = [read_standard(p).header.get("cpu_vendor", "?") for p in standard_paths(run.name)]
            state = f"committed for {', '.join(vendors)}" if vendors else "no standard yet"
            print(f"{run.name}{' (opt-in)' if run.opt_in else ''}: {run.description} [{state}]")
        return 0
    if ns.cmd == "update":
        had_standard = bool(standard_paths(ns.name))
        new, diffs = update(RUNS[ns.name], work=ns.work, add_vendor=ns.add_vendor)
        if not had_standard:
            print(f"{ns.name}: a new standard")
        elif ns.add_vendor:
            print(f"{ns.name}: agrees with the other CPU vendors' standards within ± 1e-6 + 1e-5·|x|")
        else:
            print(format_diff(ns.name, diffs) if diffs else f"{ns.name}: no registered metric changed")
        print(f"wrote {standard_path(ns.name)} ({len(new.steps)} steps, {len(new.exact)} exact "
              f"metrics, {len(new.bands)} banded); commit it")
        return 0
    unknown = [n for n in ns.names if n not in RUNS]
    if unknown:
        parser.error(f"unknown standard(s) {unknown}; known: {sorted(RUNS)}")
    names = ns.names or [r.name for r in RUNS.values() if not r.opt_in]
    failed = 0
    for name in names:
        diffs = check(RUNS[name], ns.train_args, ns.work / name if ns.work else None)
        print(format_diff(name, diffs) if diffs else f"metric gate {name!r}: matches its standard")
        failed |= bool(diffs)
    if failed:
        print("a deliberate change? `python -m milepost.metric_gate update NAME` rewrites the "
              "standard and prints the diff; commit it with the change")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
