"""`--env reasoning_gym:TASK`: checked with the settings, resolved at start into a prompt file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.connectors.env import resolve_env

pytest.importorskip("reasoning_gym", reason="needs milepost[reasoning-gym]")


@pytest.fixture
def flags(tmp_path: Path) -> list[str]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    return ["--hf-checkpoint", str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
            "--device", "cpu", "--run-dir", str(tmp_path / "run")]


def test_env_stands_for_prompt_data_and_reward_fn(flags: list[str], tmp_path: Path) -> None:
    cfg = load_config(None, [*flags, "--env", "reasoning_gym:basic_arithmetic", "--env-size", "5",
                             "--rollout-seed", "3"])
    assert cfg.prompt_data is None
    resolved = resolve_env(cfg)
    assert resolved.env is None
    assert resolved.reward_fn == "milepost.connectors.reasoning_gym:reward"
    assert resolved.prompt_data.parent == tmp_path / "run"
    rows = [json.loads(line) for line in resolved.prompt_data.read_text().splitlines()]
    assert len(rows) == 5
    assert {r["metadata"]["reasoning_gym"]["seed"] for r in rows} == {3}
    # What the ranks and a resume load: ordinary settings that validate again.
    again = load_config(resolved.write_resolved(), [])
    assert again.prompt_data == resolved.prompt_data and again.env is None
    assert resolve_env(again) is again


@pytest.mark.parametrize(("extra", "needle"), [
    (["--env", "reasoning_gym"], "give KIND:NAME"),
    (["--env", "gym:basic_arithmetic"], "give KIND:NAME"),
    (["--env", "reasoning_gym:basic_arithmetic", "--prompt-data", "{prompts}"], "drop --prompt-data"),
    (["--env", "reasoning_gym:basic_arithmetic", "--reward-fn", "math"], "drop --reward-fn math"),
    (["--env-size", "0", "--env", "reasoning_gym:basic_arithmetic"], "--env-size"),
    (["--env", "verifiers:my_env"], "through the session server: give --session-model-family"),
    (["--env", "openenv:my_env", "--session-model-family", "qwen3", "--agent-function-path",
      "milepost.testing.agent_harness:weather_agent_fn"], "drop --agent-function-path"),
    (["--env", "openenv:my_env", "--env-timeout-s", "0"], "--env-timeout-s"),
    (["--agent", "strands:my.agents"], "give KIND:MODULE:FACTORY"),
    (["--agent", "crew:my.agents:make"], "give KIND:MODULE:FACTORY"),
    (["--agent", "strands:my.agents:make"], "give --session-model-family"),
    (["--agent", "strands:my.agents:make", "--session-model-family", "qwen3",
      "--custom-generate-function-path", "a.b:c"], "drop --custom-generate-function-path"),
])
def test_bad_env_settings_are_refused(flags: list[str], tmp_path: Path, extra: list[str],
                                      needle: str) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    with pytest.raises(ConfigError, match=needle):
        load_config(None, [*flags, *[str(prompts) if a == "{prompts}" else a for a in extra]])


def test_unknown_task_is_named_at_start(flags: list[str]) -> None:
    cfg = load_config(None, [*flags, "--env", "reasoning_gym:no_such_task"])
    with pytest.raises(ValueError, match="--env reasoning_gym:no_such_task: .*no_such_task"):
        resolve_env(cfg)
