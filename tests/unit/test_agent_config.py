"""Config refusals of the agentic rollout settings (session server, plug-in layers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.config import load_config


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "x"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--num-rollout", "1",
            "--rollout-batch-size", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run")]


def _refusal(argv: list[str]) -> str:
    with pytest.raises(Exception) as e:
        load_config(None, argv)
    return str(e.value)


def test_agent_fn_turns_on_the_session_server_and_needs_a_family(base) -> None:
    msg = _refusal(base + ["--agent-function-path", "my.agent:run"])
    assert "--session-model-family" in msg
    cfg = load_config(None, base + ["--agent-function-path", "my.agent:run",
                                    "--session-model-family", "qwen3"])
    assert cfg.session_mode == "linear" and cfg.session_matcher == "strict"


def test_abort_pause_mode_is_refused_with_the_session_server(base) -> None:
    msg = _refusal(base + ["--use-session-server", "--session-model-family", "qwen3",
                           "--pause-generation-mode", "abort"])
    assert "abort would tear down" in msg


@pytest.mark.parametrize("flags,needle", [
    (["--session-model-family", "llama9"], "not registered"),
    (["--session-model-family", "qwen3", "--session-matcher", "fuzzy"], "--session-matcher"),
    (["--session-model-family", "qwen3", "--rollout-num-engines", "2", "--router", "false"],
     "needs the router"),
])
def test_bad_session_settings_are_refused(base, flags, needle) -> None:
    assert needle in _refusal(base + ["--use-session-server", *flags])


def test_layer_paths_must_be_import_paths(base) -> None:
    assert "not an import path" in _refusal(base + ["--rollout-function-path", "nocolon"])


def test_agent_and_generate_fns_run_under_fully_async_but_a_rollout_fn_does_not(base) -> None:
    cfg = load_config(None, base + ["--fully-async", "--agent-function-path", "my.agent:run",
                                    "--session-model-family", "qwen3",
                                    "--pause-generation-mode", "in_place"])
    assert cfg.fully_async and cfg.agent_function_path == "my.agent:run"
    load_config(None, base + ["--fully-async", "--custom-generate-function-path", "my.gen:run"])
    msg = _refusal(base + ["--fully-async", "--rollout-function-path", "my.roll:run"])
    assert "owns data and grouping" in msg
