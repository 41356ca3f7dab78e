"""The metric gate catches real changes: a fresh deterministic run of the CI standard (`pipeline`,
milepost/gate_runs.py) with a perturbed loss coefficient, or with its samplers given other seeds,
must differ from the committed standard where it should, with a readable diff. One rollout each,
so each run costs its start-up; `.ci/run` runs the unperturbed check (python -m milepost.metric_gate)."""

from __future__ import annotations

from pathlib import Path

from milepost.gate_runs import RUNS
from milepost.metric_gate import check, format_diff


def _at_step0(diffs: list) -> set[str]:
    return {d.metric for d in diffs if d.step == 0}


def test_a_changed_loss_coefficient_fails_the_gate(tmp_path: Path) -> None:
    diffs = check(RUNS["pipeline"], ["--entropy-coef", "0.002", "--num-rollout", "1"], work=tmp_path)
    changed = _at_step0(diffs)
    assert "train/loss" in changed, format_diff("pipeline", diffs)
    # The rollout before the first update sampled exactly what the standard's did: only the
    # loss moved, so the gate points at the training side.
    assert not {m for m in changed if m.startswith("rollout/")}, format_diff("pipeline", diffs)
    text = format_diff("pipeline", diffs)
    assert "train/loss" in text and "bit for bit" in text and "first differing step: 0" in text


def test_other_sampler_seeds_fail_the_gate(tmp_path: Path) -> None:
    diffs = check(RUNS["pipeline"], ["--seed", "8", "--num-rollout", "1"], work=tmp_path)
    changed = _at_step0(diffs)
    assert {"train/entropy", "train/loss"} <= changed, format_diff("pipeline", diffs)
