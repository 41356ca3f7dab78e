"""The terminal environment's easy tier (issue 25 item 4): every task fails from its starting
files and passes after its reference solution, blanket commands earn nothing, the held-out part
shares no task with the trained part, and the prompt file of a tier names its tasks."""

from __future__ import annotations

import json

import pytest

import milepost.envs.sandbox as sb
from milepost.envs.sandbox import Sandbox
from milepost.envs.tasks import (
    EASY_HELDOUT_TASKS,
    EASY_TASKS,
    TASKS,
    TASKS_BY_NAME,
    main,
)

# Commands that touch everything or nothing: none may solve a task it was not written for.
BLANKET = ("true", "rm -rf ./* ./.[!.]*", "touch ./*", "mkdir x", "echo hello > word.txt")


@pytest.fixture
def plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the graders unisolated in the sandbox's temp directory: they and the reference
    solutions are ours, and a bubblewrap launch per command made this file take ~25 s on the
    busy CI machine (test_terminal_env.py covers the isolation itself)."""
    monkeypatch.setattr(sb, "isolation_problem", lambda: "graders only")


def test_tiers_are_disjoint_and_the_standard_tasks_unchanged() -> None:
    easy = {t.name for t in EASY_TASKS}
    held = {t.name for t in EASY_HELDOUT_TASKS}
    assert len(easy) == len(EASY_TASKS) == 30 and len(held) == len(EASY_HELDOUT_TASKS) == 18
    assert not easy & held and not (easy | held) & {t.name for t in TASKS}
    assert len(TASKS) == 12 and len(TASKS_BY_NAME) == 12 + 30 + 18
    # held out = new names for the same kinds of goal: every kind is in both parts
    assert {n.split("_")[1] for n in easy} == {n.split("_")[1] for n in held}


def test_every_easy_task_is_graded_by_its_own_test(plain: None) -> None:
    for task in EASY_TASKS + EASY_HELDOUT_TASKS:
        with Sandbox(task.files, allow_unsafe_no_sandbox=True) as box:
            assert box.run(task.test).exit_code != 0, f"{task.name}: start state passes"
            solved = box.run(task.solution)
            assert solved.exit_code == 0, (task.name, solved.output)
            assert box.run(task.test).exit_code == 0, f"{task.name}: solution fails its test"


@pytest.mark.parametrize("command", BLANKET)
def test_blanket_commands_do_not_pass(command: str, plain: None) -> None:
    # one task of each kind whose goal the command does not happen to name
    picks = {t.name.split("_")[1]: t for t in EASY_TASKS if t.name != "easy_echo_hello"}
    for task in picks.values():
        with Sandbox(task.files, allow_unsafe_no_sandbox=True) as box:
            assert not box.isolated
            box.run(command)
            assert box.run(task.test).exit_code != 0, f"{task.name} passed after {command!r}"


def test_prompt_file_of_a_tier(tmp_path) -> None:
    assert main([str(tmp_path / "e.jsonl"), "--tier", "easy_heldout"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == [t.name for t in EASY_HELDOUT_TASKS]
    assert rows[0]["prompt"] == EASY_HELDOUT_TASKS[0].instruction
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x.jsonl"), "--tier", "hard"])
