"""The reasoning-gym connector: procedural prompts (seeded, offline) scored by the task's scorer."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from milepost.connectors.extras import MissingExtraError
from milepost.rollout.rewards import load_reward_fn, score_group
from milepost.types import Sample

pytest.importorskip("reasoning_gym", reason="needs milepost[reasoning-gym]")
from milepost.connectors import reasoning_gym as rgc  # after the skip


def _sample(row: dict, response: str) -> Sample:
    return Sample(group_index=0, index=0, tokens=[1, 2], response_length=1, prompt=row["prompt"],
                  response=response, label=row["label"], metadata=dict(row["metadata"]))


@pytest.mark.parametrize("task", ["basic_arithmetic", "spell_backward"])
def test_right_answers_score_one_and_wrong_or_missing_zero(task: str) -> None:
    rows = rgc.prompt_rows(task, size=5, seed=11)
    assert len(rows) == 5
    for row in rows:
        assert row["prompt"][0]["role"] == "system" and "<answer>" in row["prompt"][0]["content"]
        right = f"<think>working</think>It is <answer>{row['label']}</answer>"
        assert rgc.reward(_sample(row, right)) == 1.0
        assert rgc.reward(_sample(row, "<answer>surely not this 0.123</answer>")) < 1.0
        assert rgc.reward(_sample(row, f"the answer is {row['label']}")) == 0.0  # no tags
        assert rgc.reward(_sample(row, f"<think><answer>{row['label']}</answer>")) == 0.0


def test_prompts_are_seeded() -> None:
    a = rgc.prompt_rows("basic_arithmetic", size=6, seed=1)
    assert a == rgc.prompt_rows("basic_arithmetic", size=6, seed=1)
    assert a != rgc.prompt_rows("basic_arithmetic", size=6, seed=2)


def test_task_config_reaches_the_generator() -> None:
    rows = rgc.prompt_rows("basic_arithmetic", size=4, seed=0, system_prompt="",
                           config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    for row in rows:
        assert len(row["prompt"]) == 1  # no system prompt
        assert row["metadata"]["reasoning_gym"]["config"]["max_terms"] == 2
        assert rgc.reward(_sample(row, f"<answer>{row['label']}</answer>")) == 1.0


def test_cli_writes_prompt_data_and_refuses_bad_input(tmp_path, capsys) -> None:
    out = tmp_path / "p.jsonl"
    assert rgc.main(["basic_arithmetic", "--size", "3", "--seed", "4", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == rgc.prompt_rows("basic_arithmetic", size=3, seed=4)
    for argv, needle in [(["no_such_task"], "no_such_task"),
                         (["basic_arithmetic", "--config", "[1]"], "--config"),
                         (["basic_arithmetic", "--config", '{"min_terms": 0}'], "min_terms"),
                         (["basic_arithmetic", "--system-prompt", "nope"], "system_prompt")]:
        with pytest.raises(SystemExit):
            rgc.main([*argv, "--out", str(tmp_path / "x.jsonl")])
        assert needle in capsys.readouterr().err


def test_sample_without_its_metadata_is_an_error_not_a_zero() -> None:
    s = Sample(group_index=0, index=0, tokens=[1], response_length=1, response="<answer>1</answer>")
    error = asyncio.run(score_group([s], rgc.reward))
    assert error is not None and "metadata['reasoning_gym']" in error and s.reward is None


def test_missing_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # None in sys.modules: not there
    with pytest.raises(MissingExtraError, match=r"pip install 'milepost\[reasoning-gym\]'"):
        rgc.prompt_rows("basic_arithmetic", size=1, seed=0)
    # A run is refused at start: preflight loads the reward fn, which imports the connector.
    monkeypatch.delitem(sys.modules, "milepost.connectors.reasoning_gym")
    with pytest.raises(ValueError, match=r"reward_fn: .*pip install 'milepost\[reasoning-gym\]'"):
        load_reward_fn("milepost.connectors.reasoning_gym:reward")
