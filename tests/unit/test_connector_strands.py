"""The Strands connector's plumbing: --agent resolved into import paths that load again, the
prompt an agent is invoked with, and a failed episode's grade refused with its reason."""

from __future__ import annotations

import pytest

from milepost.connectors.episodes import ERROR_KEY
from milepost.plugins import load_callable
from milepost.types import Sample

pytest.importorskip("strands", reason="needs milepost[strands]")
from milepost.connectors import strands_agent as sac  # after the skip


def test_agent_setting_resolves_to_paths_that_load() -> None:
    paths = sac.settings_for("milepost.testing.agent_harness:WeatherAgent", "exact_match", 7.5)
    agent = load_callable(paths["agent_function_path"], "--agent-function-path")
    assert callable(agent)
    assert "7.5" in bytes.fromhex(paths["agent_function_path"].rsplit("_", 1)[1]).decode()
    reward = load_callable(paths["reward_fn"], "--reward-fn")
    s = Sample(group_index=0, index=0, tokens=[1], response_length=0, response="4", label="4")
    assert reward(s) == 1.0
    s.metadata[ERROR_KEY] = "strands agent: RuntimeError: tool broke"
    with pytest.raises(RuntimeError, match="tool broke"):
        reward(s)
    assert paths["custom_generate_function_path"] == "milepost.connectors.strands_agent:generate"


def test_a_factory_that_cannot_be_imported_is_named() -> None:
    with pytest.raises(ValueError, match="--agent strands:no_such_mod:make"):
        sac.settings_for("no_such_mod:make", "exact_match")


def test_prompt_text() -> None:
    assert sac.prompt_text("Weather in Oslo?") == "Weather in Oslo?"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert sac.prompt_text(chat) == "c"
    with pytest.raises(ValueError, match="needs a user message"):
        sac.prompt_text([{"role": "system", "content": "x"}])
