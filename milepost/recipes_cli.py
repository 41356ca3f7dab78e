"""`milepost recipes`: every recipe in recipes/ with its evidence level (report section 6).

A recipe's `[evidence]` table states its level and what backs it; `evidence_problems` turns each
level into checks CI runs (tests/unit/test_recipes_evidence.py), so a level is a claim, not a label:
- fully_gated: a complete curve was run, and a deterministic gate run (milepost/gate_runs.py) runs
  the recipe itself against a committed standard in benchmarks/history/.
- proxy_gated: the same, with a documented scaled-down proxy of the recipe as the gate run.
- verified: a complete training curve was run (what, when, on which machine, where the numbers
  are); no deterministic test meets either standard above.
- not_verified: no complete curve; smoke tests and short debugging runs do not count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
HISTORY = ROOT / "benchmarks" / "history"
Level = Literal["fully_gated", "proxy_gated", "verified", "not_verified"]
LEVEL_TEXT = {"fully_gated": "fully gated", "proxy_gated": "proxy gated", "verified": "verified",
              "not_verified": "not verified"}


class Evidence(BaseModel):
    """A recipe's `[evidence]` table (it holds no setting: `milepost train` skips it)."""

    model_config = ConfigDict(extra="forbid")
    level: Level = Field(description="fully_gated | proxy_gated | verified | not_verified")
    run: str = Field("", description="What was run: the command or its scale, and how many runs "
                     "(required above not_verified).")
    when: str = Field("", description="Date(s) of the runs, YYYY-MM-DD.")
    machine: str = Field("", description="Where: hardware, load, torch version.")
    results: str = Field("", description="Where the numbers are: 'path' or 'path: heading'.")
    gate: str = Field("", description="The gate run (milepost/gate_runs.py RUNS) of a gated level.")


def read_evidence(path: Path) -> Evidence:
    """The `[evidence]` table of recipe `path`; ValueError naming the file and the field at fault."""
    doc = tomllib.loads(path.read_text())
    if "evidence" not in doc:
        raise ValueError(f"{path.name}: no [evidence] table; add one with level = one of "
                         f"{list(LEVEL_TEXT)} (docs/recipes.md says what each means)")
    try:
        return Evidence(**doc["evidence"])
    except ValidationError as err:
        raise ValueError(f"{path.name} [evidence]: {err}") from err


def _results_found(results: str) -> str | None:
    """None when `results` names an existing file (and heading in it), else what is missing."""
    file, _, heading = results.partition(": ")
    target = ROOT / file
    if not target.is_file():
        return f"results file {file!r} does not exist"
    if heading and not any(line.lstrip("#").strip().startswith(heading)
                           for line in target.read_text().splitlines() if line.startswith("#")):
        return f"{file} has no heading starting {heading!r}"
    return None


def evidence_problems(path: Path) -> list[str]:
    """What in recipe `path`'s evidence does not hold; empty when its level's claim checks out."""
    from milepost.gate_runs import RUNS

    try:
        ev = read_evidence(path)
    except ValueError as err:
        return [str(err)]
    name, problems = path.name, []
    if ev.level != "not_verified":
        for field in ("run", "when", "machine", "results"):
            if not getattr(ev, field).strip():
                problems.append(f"{name}: level {ev.level} needs [evidence] {field}")
        if ev.results and (missing := _results_found(ev.results)):
            problems.append(f"{name}: {missing}")
    if ev.level in ("fully_gated", "proxy_gated"):
        run = RUNS.get(ev.gate)
        if run is None:
            problems.append(f"{name}: level {ev.level} needs gate = one of {sorted(RUNS)}")
            return problems
        wanted = f"recipes/{name}"
        if ev.level == "fully_gated" and run.recipe != wanted:
            problems.append(f"{name}: gate {ev.gate!r} does not run {wanted} itself")
        if ev.level == "proxy_gated" and run.proxy_of != wanted:
            problems.append(f"{name}: gate {ev.gate!r} is not a documented proxy of {wanted}")
        if not (HISTORY / f"{ev.gate}.jsonl").is_file():
            problems.append(f"{name}: no committed standard benchmarks/history/{ev.gate}.jsonl")
    elif ev.gate:
        problems.append(f"{name}: gate {ev.gate!r} given, but level {ev.level} claims no gate")
    return problems


def recipe_paths() -> list[Path]:
    return sorted(RECIPES.glob("*.toml"))


def add_recipes_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "recipes", help="the recipes in recipes/ with their evidence levels",
        description="List every recipe with its evidence level (fully gated, proxy gated, "
        "verified, not verified: docs/recipes.md), what was run, when and on which machine.")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 naming every recipe whose evidence does not hold")
    parser.set_defaults(run=run)


def run(ns: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="milepost recipes", show_lines=True)
    table.add_column("recipe", no_wrap=True)
    table.add_column("level", no_wrap=True)
    for column in ("what was run", "when", "machine"):
        table.add_column(column, overflow="fold")
    problems: list[str] = []
    for path in recipe_paths():
        problems += evidence_problems(path)
        try:
            ev = read_evidence(path)
        except ValueError:
            table.add_row(path.name, "[red]missing[/red]", "", "", "")
            continue
        table.add_row(path.name, LEVEL_TEXT[ev.level], ev.run, ev.when, ev.machine)
    console = Console()
    console.print(table)
    for p in problems:
        console.print(f"[red]evidence does not hold:[/red] {p}")
    return 1 if problems and ns.check else 0
