"""Every recipe states its evidence level, and the level's claim holds (report section 6):
gated levels name a gate run of the recipe (or its documented proxy) with a committed standard;
verified names what was run, when, where, and numbers that exist; `milepost recipes` lists them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from milepost.config import TABLE_OF
from milepost.recipe import read_recipe
from milepost.recipes_cli import RECIPES, evidence_problems, read_evidence, recipe_paths, run

VERIFIED = '''
[evidence]
level = "verified"
run = "one run of 40 rollouts"
when = "2026-12-03"
machine = "2 CPU cores"
results = "benchmarks/RESULTS.md: Tiny demo"
'''


def _recipe(tmp_path: Path, evidence: str) -> Path:
    path = tmp_path / "r.toml"
    path.write_text('[rollout]\nnum_rollout = 2\n' + evidence)
    return path


@pytest.mark.parametrize("path", recipe_paths(), ids=lambda p: p.name)
def test_every_recipe_level_holds(path: Path) -> None:
    assert not evidence_problems(path)


def test_the_recipes_are_there() -> None:
    names = {p.name for p in recipe_paths()}
    assert {"tiny_demo.toml", "agentic_terminal.toml"} <= names


def test_a_verified_recipe_must_say_what_when_where(tmp_path: Path) -> None:
    assert not evidence_problems(_recipe(tmp_path, VERIFIED))
    bare = _recipe(tmp_path, VERIFIED.replace('machine = "2 CPU cores"\n', ""))
    assert evidence_problems(bare) == ["r.toml: level verified needs [evidence] machine"]
    lost = _recipe(tmp_path, VERIFIED.replace(": Tiny demo", ": No such section"))
    assert "has no heading starting 'No such section'" in evidence_problems(lost)[0]


def test_a_gated_claim_needs_its_gate_and_standard(tmp_path: Path) -> None:
    fully = _recipe(tmp_path, VERIFIED.replace('"verified"', '"fully_gated"'))
    assert any("needs gate = one of" in p for p in evidence_problems(fully))
    # The CI gate run exists, but it runs no recipe: it cannot make r.toml fully gated.
    claimed = _recipe(tmp_path, VERIFIED.replace('"verified"', '"fully_gated"') + 'gate = "pipeline"\n')
    assert "r.toml: gate 'pipeline' does not run recipes/r.toml itself" in evidence_problems(claimed)
    proxy = _recipe(tmp_path, VERIFIED.replace('"verified"', '"proxy_gated"') + 'gate = "pipeline"\n')
    assert any("not a documented proxy" in p for p in evidence_problems(proxy))
    stray = _recipe(tmp_path, VERIFIED + 'gate = "pipeline"\n')
    assert evidence_problems(stray) == ["r.toml: gate 'pipeline' given, but level verified claims no gate"]


def test_missing_or_unknown_level_is_named(tmp_path: Path) -> None:
    assert "no [evidence] table" in evidence_problems(_recipe(tmp_path, ""))[0]
    odd = _recipe(tmp_path, '\n[evidence]\nlevel = "trust me"\nrun = "x"\n')
    assert "level" in evidence_problems(odd)[0]


def test_train_skips_the_evidence_table(tmp_path: Path) -> None:
    flat = read_recipe(_recipe(tmp_path, VERIFIED), TABLE_OF)
    assert flat == {"num_rollout": 2}
    assert read_evidence(RECIPES / "tiny_demo.toml").level in (
        "verified", "fully_gated", "proxy_gated")


def test_recipes_command_lists_levels(capsys) -> None:
    assert run(argparse.Namespace(check=True)) == 0
    out = capsys.readouterr().out
    for path in recipe_paths():
        assert path.name in out
    assert "not verified" in out and "verified" in out
