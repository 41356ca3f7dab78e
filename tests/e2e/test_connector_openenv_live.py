"""`milepost train --env openenv:NAME`: an OpenEnv environment served by its own server process
(OpenEnv's `create_app`, uvicorn, loopback), driven through OpenEnv's client; the rewards its
server computed are the ones trained on; a seed whose step raises fails its group, the run
goes on (issue 25).

The environment package is written by the test (on PYTHONPATH, as an installed one would be).
Its server appends every step's reward, by episode id, to a file the test reads back.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from milepost.data.rollout_io import load_rollout

pytest.importorskip("openenv", reason="needs milepost[openenv]")

STEPS = 2

APP_SOURCE = '''
import json
import os

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SayAction(Action):
    message: str


class SayObservation(Observation):
    prompt: str = ""


class SayEnv(Environment):
    """Two steps; each reply of odd length scores 1. Seed 5 breaks on its first step."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # four at a time: more episodes than that wait their turn

    def __init__(self):
        super().__init__()
        self._state, self._seed = State(step_count=0), None

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state, self._seed = State(episode_id=episode_id, step_count=0), seed
        return SayObservation(prompt=f"Say something odd ({seed}).")

    def step(self, action, timeout_s=None, **kwargs):
        if self._seed == 5:
            raise RuntimeError("the say environment broke on purpose")
        self._state.step_count += 1
        reward = float(len(action.message) % 2)
        with open(os.environ["SAY_ENV_LOG"], "a") as f:
            f.write(json.dumps({"episode": self._state.episode_id, "reward": reward}) + "\\n")
        return SayObservation(prompt="Again.", reward=reward, done=self._state.step_count >= 2)

    @property
    def state(self):
        return self._state


app = create_app(SayEnv, SayAction, SayObservation, env_name="say_env", max_concurrent_envs=4)
'''


def test_server_rewards_flow_into_training_and_a_broken_step_fails(qwen3_dir: Path,
                                                                    tmp_path: Path) -> None:
    pkg = tmp_path / "envs"
    (pkg / "say_env" / "server").mkdir(parents=True)
    for init in (pkg / "say_env" / "__init__.py", pkg / "say_env" / "server" / "__init__.py"):
        init.write_text("")
    (pkg / "say_env" / "server" / "app.py").write_text(APP_SOURCE)
    log = tmp_path / "steps.jsonl"
    run_dir, saved = tmp_path / "run", tmp_path / "rollouts"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(qwen3_dir),
           "--env", "openenv:say_env", "--env-size", "8", "--rollout-seed", "0",
           "--session-model-family", "qwen3", "--num-rollout", str(STEPS),
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "16", "--engine-max-total-tokens", "4096",
           # A random model seldom samples EOS (a cut turn ends the episode): a fifth of the
           # vocabulary ends a turn, so most episodes take both steps.
           "--rollout-stop-token-ids", ",".join(map(str, range(3, 100))),
           "--seed", "3", "--run-dir", str(run_dir), "--save-rollouts", str(saved),
           "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAY_ENV_LOG": str(log),
           "PYTHONPATH": os.pathsep.join([str(pkg), os.environ.get("PYTHONPATH", "")])}
    # ~60 s on 2 idle cores (OpenEnv's server and client imports are ~15 s of it under load).
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          timeout=300 * STEPS)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    by_episode: dict[str, float] = defaultdict(float)
    for line in log.read_text().splitlines():
        step = json.loads(line)
        by_episode[step["episode"]] += step["reward"]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    turns = []
    for step in range(STEPS):
        samples = [s for g in load_rollout(saved, step) for s in g]
        assert len(samples) == 8
        for s in samples:  # what the environment's server computed is what was trained on
            assert s.reward == by_episode[s.metadata["openenv_episode"]]
            turns.append(s.metadata["openenv_turns"])
        assert "train/loss" in metrics[step]
    assert max(turns) == 2  # multi-turn: the observation after a step went back to the model
    # Eight seeds, seven healthy: eight trained groups needed seed 5 at least once.
    assert sum(m["rollout/reward_errors"] for m in metrics) >= 1, metrics
    assert "the say environment broke on purpose" in out
    # The server died with the trainer rank that started it (which leaves by os._exit).
    server_log = (run_dir / "logs" / "openenv-say_env.log").read_text()
    pids = [int(x) for x in re.findall(r"Started server process \[(\d+)\]", server_log)]
    assert len(pids) == 1, server_log[-2000:]
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pids[0]}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{pids[0]}").exists(), "the OpenEnv server outlived the run"
