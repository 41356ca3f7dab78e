"""Divergence through `milepost train`: an agent that drops reasoning on replay, on linear sessions
with `--session-divergence rollback`, trains, and the step's metrics count the rollbacks and the
sampled tokens they turned into context (rollout/session_rollbacks, .../retokenized_tokens)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.testing.agent_model import make_agent_model


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_agent_model(tmp_path_factory.getbasetemp() / "agent_model_shared")


def test_rollbacks_reach_the_run_metrics(agent_dir, tmp_path) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"Weather in {c}?"}], "label": w}
            for c, w in [("Oslo", "snow"), ("Rome", "hot")]]
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(agent_dir),
           "--prompt-data", str(data), "--num-rollout", "1", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "64",
           "--rollout-temperature", "0.1", "--global-batch-size", "4",
           "--engine-max-total-tokens", "8192", "--run-dir", str(run_dir),
           "--agent-function-path", "milepost.testing.agent_harness:forking_weather_agent_fn",
           "--session-model-family", "qwen3", "--session-divergence", "rollback",
           "--reward-fn", "milepost.rollout.layers:agent_reward"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (m,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "train/loss" in m
    # A trajectory whose first turn calls the tool (the tiny model does, nearly always) replays
    # that turn without its reasoning: a rollback, counted.
    assert m["rollout/session_rollbacks"] >= 1, m
    assert m["rollout/session_retokenized_tokens"] > 0
    assert m["rollout/session_rejections"] == 0 and m["rollout/session_forks"] == 0
