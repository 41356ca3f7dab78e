"""`milepost train --agent strands:MODULE:FACTORY`: a real Strands agent (its OpenAI model provider,
its tool loop) drives the session server; the run's reward fn grades its final text, and those
rewards are trained on (issue 25). Measured: 2 and 3 of 4 trajectories ran the tool in two runs.

The model is the tiny tool-calling checkpoint (`milepost.testing.agent_model`, taught with the
tool list in its prompts): asked "Weather in X?", it calls `get_weather`, which the Strands agent
runs, and answers from the result. The agent
module and the reward are written by the test (on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.data.rollout_io import load_rollout
from milepost.testing.agent_model import make_agent_model

pytest.importorskip("strands", reason="needs milepost[strands]")

STRANDS_WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "Property city"}}, "required": ["city"]}}}

AGENT_SOURCE = '''
from strands import Agent, tool

WEATHER = {"Oslo": "snow", "Rome": "hot"}
CALLS = []


# The schema the tiny model was taught with (STRANDS_WEATHER_TOOL).
@tool(inputSchema={"json": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}})
def get_weather(city: str) -> str:
    """Current weather of a city"""
    CALLS.append(city)
    return WEATHER.get(city, "unknown")


def make_agent(model):
    return Agent(model=model, tools=[get_weather], callback_handler=None)


def answers_from_the_tool(sample):  # the tiny model often names the wrong weather: no label
    return float(sample.response.startswith("It is "))
'''


@pytest.fixture(scope="session")
def agent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Taught with the tool list in its prompts exactly as Strands sends it (Strands adds a
    # description to each property).
    return make_agent_model(tmp_path_factory.getbasetemp() / "agent_model_strands",
                            tools=[STRANDS_WEATHER_TOOL])


def test_strands_agent_drives_the_session_and_its_graded_answers_train(agent_dir: Path,
                                                                         tmp_path: Path) -> None:
    pkg = tmp_path / "agents"
    pkg.mkdir()
    (pkg / "weather_agents.py").write_text(AGENT_SOURCE)
    rows = [{"prompt": [{"role": "user", "content": f"Weather in {c}?"}], "label": w}
            for c, w in [("Oslo", "snow"), ("Rome", "hot")]]
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir, saved = tmp_path / "run", tmp_path / "rollouts"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(agent_dir),
           "--prompt-data", str(data), "--agent", "strands:weather_agents:make_agent",
           "--reward-fn", "weather_agents:answers_from_the_tool", "--session-model-family", "qwen3",
           # Strands sends no reasoning_content back: the stored turn's reasoning is omitted.
           "--session-matcher", "omit_reasoning",
           "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "64", "--rollout-temperature", "0.3", "--engine-max-total-tokens", "8192",
           "--run-dir", str(run_dir), "--save-rollouts", str(saved), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(pkg), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(agent_dir)
    samples = [s for g in load_rollout(saved, 0) for s in g]
    assert len(samples) == 4
    tool_rounds = 0
    for s in samples:
        assert s.response == s.metadata["agent_text"]  # the agent's final text, graded
        assert s.reward == float(s.response.startswith("It is "))
        text = tok.decode(s.tokens)
        if "<tool_response>" in text:  # Strands ran the tool: its result is context, not trained
            tool_rounds += 1
            assert 0 < sum(s.loss_mask) < s.response_length
    print(f"{tool_rounds} of 4 trajectories ran the tool; rewards {[s.reward for s in samples]}")
    assert tool_rounds > 0
    (m,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "train/loss" in m and m["rollout/reward_errors"] == 0
