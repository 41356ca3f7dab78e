"""`milepost train --env verifiers:NAME`: a real verifiers multi-turn environment, its rollouts run
through the session server, its rubric's rewards trained on; a prompt whose environment breaks
is counted failed with the reason and the run goes on (issue 25).

The environment is written by the test (a module on PYTHONPATH, as an installed environment
package would be): it answers each model turn with "go on" until a reply of even length or three
turns, and its rubric gives turns / 3, which the test recounts from the trained tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.data.rollout_io import load_rollout

pytest.importorskip("verifiers", reason="needs milepost[verifiers]")

STEPS = 2

ENV_SOURCE = '''
import math
import verifiers as vf
from datasets import Dataset

MODES = ["ok"] * 6 + ["env_raises", "nan_reward"]


def _content(message):
    return (message.get("content") if isinstance(message, dict) else message.content) or ""


class Counting(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        if state["info"]["mode"] == "env_raises":
            raise RuntimeError("the counting environment broke on purpose")
        if len(_content(messages[-1])) % 2 == 0:
            state["final_env_response"] = [{"role": "user", "content": "done"}]
        return [{"role": "user", "content": "go on"}]


def turns(state, info, **kwargs):
    return math.nan if info["mode"] == "nan_reward" else len(state["trajectory"]) / 3


def load_environment():
    rows = [{"question": f"Count with me ({i}).", "answer": "", "info": {"mode": m}}
            for i, m in enumerate(MODES)]
    return Counting(dataset=Dataset.from_list(rows), max_turns=3,
                    rubric=vf.Rubric(funcs=[turns]))
'''


def test_rubric_rewards_flow_into_training_and_broken_episodes_fail(qwen3_dir: Path,
                                                                     tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    pkg = tmp_path / "envs"
    pkg.mkdir()
    (pkg / "counting_env.py").write_text(ENV_SOURCE)
    run_dir, saved = tmp_path / "run", tmp_path / "rollouts"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(qwen3_dir),
           "--env", "verifiers:counting_env", "--session-model-family", "qwen3",
           "--num-rollout", str(STEPS), "--rollout-batch-size", "4", "--n-samples-per-prompt",
           "2", "--rollout-max-response-len", "16", "--engine-max-total-tokens", "4096",
           # A random model seldom samples EOS (a turn cut at the length limit ends the episode):
           # a fifth of the vocabulary ends a turn, so most episodes have several.
           "--rollout-stop-token-ids", ",".join(map(str, range(3, 100))),
           "--seed", "3", "--run-dir", str(run_dir), "--save-rollouts", str(saved),
           "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(pkg), os.environ.get("PYTHONPATH", "")])}
    # ~40 s on 2 idle cores (verifiers' import is ~5 s of it); generous for a loaded machine.
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          timeout=300 * STEPS)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    resolved = (run_dir / "config.resolved.toml").read_text()
    assert f"milepost.connectors.verifiers_env:agent_{b'counting_env'.hex()}" in resolved
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for step in range(STEPS):
        samples = [s for g in load_rollout(saved, step) for s in g]
        assert len(samples) == 8
        for s in samples:  # only the healthy prompts are trained on, graded by the rubric
            meta = s.metadata
            assert "env_error" not in meta and meta["verifiers_metrics"]["turns"] == s.reward
            text = tok.decode(s.tokens)
            assert s.reward == text.count("<|im_start|>assistant") / 3, text
            if s.reward > 1 / 3:  # the environment's turns are context, not trained on
                response = tok.decode(s.tokens[-s.response_length:])
                assert "go on" in response and 0 < sum(s.loss_mask) < s.response_length
        assert "train/loss" in metrics[step]
        assert metrics[step]["rollout/reward_mean"] == pytest.approx(
            sum(s.reward for s in samples) / len(samples))
    # Eight prompts, six healthy: eight trained groups needed every broken prompt at least once.
    assert sum(m["rollout/reward_errors"] for m in metrics) >= 2, metrics
    assert "the counting environment broke on purpose" in out
    assert "malformed reward nan" in out
