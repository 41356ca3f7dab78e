"""Contract tests of the three rollout layers (report 2.3 table 4) against a real engine and
session server, and the agent layer wired into `milepost train`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from milepost.data.source import PromptItem
from milepost.rollout.client import EngineClient
from milepost.rollout.generate import SamplingSettings
from milepost.rollout.layers import (
    GenerateContext,
    LayerContractError,
    RolloutContext,
    agent_reward,
    default_generate,
    default_rollout,
    load_layer,
)
from milepost.session.runner import SessionServerThread
from milepost.session.service import SessionSettings
from milepost.testing.server_process import ServerProcess
from milepost.types import Status


@pytest.fixture
def engine(agent_engine: ServerProcess) -> ServerProcess:
    """The session's shared engine of `agent_dir` (tests/e2e/conftest.py): the session tests'
    engine, not one more process start; these tests only generate on it."""
    return agent_engine


class _Items:
    def __init__(self, items):
        self.items = list(items)

    def next_batch(self, n):
        out, self.items = self.items[:n], self.items[n:]
        return out


def _items(tok_dir: Path) -> list[PromptItem]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    out = []
    for i, (city, cond) in enumerate([("Oslo", "snow"), ("Rome", "hot")]):
        msgs = [{"role": "user", "content": f"Weather in {city}?"}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append(PromptItem(index=i, prompt=msgs, prompt_ids=ids, label=cond))
    return out


def _run(ctx_fn, items, generate_fn, rollout_fn=default_rollout, agent=None, session_url=None,
         reward_fn=None, engine_url=None):
    async def go():
        clients = [EngineClient(engine_url)]
        http = httpx.AsyncClient(timeout=120)
        sampling = SamplingSettings(temperature=1.0, max_new_tokens=64)
        try:
            ctx = RolloutContext(
                data=_Items(items), num_groups=len(items), n_samples_per_prompt=2,
                group_index_start=10, generate_fn=generate_fn,
                generate_context=lambda g: GenerateContext(
                    clients=clients, sampling=sampling, group_index=g, session_url=session_url,
                    agent_fn=agent, http=http),
                reward_fn=reward_fn, group_reward_fn=None)
            return await rollout_fn(ctx)
        finally:
            await http.aclose()
            await clients[0].aclose()
    return asyncio.run(go())


def test_agent_layer_records_tokens_through_the_session_server(agent_dir, engine):
    agent = load_layer("milepost.testing.agent_harness:weather_agent_fn", "--agent-function-path")
    with SessionServerThread(agent_dir, engine.url, family="qwen3",
                             settings=SessionSettings(sampling={"max_new_tokens": 64,
                                                                "temperature": 0.0},
                                                      enforce_sampling=True)) as srv:
        result = _run(None, _items(agent_dir), default_generate, agent=agent,
                      session_url=srv.url, reward_fn=agent_reward, engine_url=engine.url)
        assert not srv.service.sessions  # every session was closed after its episode
    assert [s.group_index for g in result.groups for s in g] == [10, 10, 11, 11]
    for s in (s for g in result.groups for s in g):
        assert s.status is Status.COMPLETED and s.reward in (0.0, 1.0)
        assert s.metadata["turns"] >= 2  # tool call, then the answer
        assert len(s.loss_mask) == s.response_length == len(s.rollout_logprobs)
        assert 0 < sum(s.loss_mask) < s.response_length  # tool results are not trained on
        assert s.reward == s.metadata["agent_reward"]


def test_generate_layer_records_its_own_tokens(agent_dir, engine):
    fn = load_layer("milepost.testing.layer_examples:two_pass_generate", "gen")
    result = _run(None, _items(agent_dir), fn, reward_fn=lambda s: 1.0, engine_url=engine.url)
    samples = [s for g in result.groups for s in g]
    assert len(samples) == 4 and all(s.metadata["passes"] == 2 for s in samples)
    assert all(s.loss_mask.count(0) == 2 and len(s.loss_mask) == s.response_length
               for s in samples)


def test_rollout_layer_owns_tasks_and_group_rewards(agent_dir, engine):
    fn = load_layer("milepost.testing.layer_examples:own_taskset_rollout", "roll")
    result = _run(None, _items(agent_dir), default_generate, rollout_fn=fn,
                  engine_url=engine.url)
    assert len(result.groups) == 2
    for g in result.groups:
        assert max(s.reward for s in g) == 1.0
        assert {s.prompt for s in g} <= {"Weather in Oslo?", "Weather in Rome?"}


def test_a_layer_that_breaks_its_contract_is_refused(agent_dir, engine):
    fn = load_layer("milepost.testing.layer_examples:broken_generate", "gen")
    with pytest.raises(LayerContractError, match="generate fn returned dict"):
        _run(None, _items(agent_dir), fn, reward_fn=lambda s: 1.0, engine_url=engine.url)


def test_milepost_train_with_an_agent_fn(agent_dir, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Weather in {c}?"}], "label": w}
            for c, w in [("Oslo", "snow"), ("Rome", "hot"), ("Lima", "mild"), ("Bern", "snow")]]
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(agent_dir),
           "--prompt-data", str(data), "--num-rollout", "2", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "64",
           "--engine-max-total-tokens", "8192", "--run-dir", str(run_dir),
           "--agent-function-path", "milepost.testing.agent_harness:weather_agent_fn",
           "--session-model-family", "qwen3",
           "--reward-fn", "milepost.rollout.layers:agent_reward"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert all("train/loss" in m and m["rollout/response_len_mean"] > 0 for m in lines)



def test_milepost_train_trains_every_selected_leaf_of_a_branching_session(agent_dir, tmp_path):
    """An agent that drops reasoning on replay forks its branching session; with
    --session-leaf-selection all every leaf reaches the trainer as its own sequence."""
    from milepost.data.rollout_io import load_rollout

    rows = [{"prompt": [{"role": "user", "content": f"Weather in {c}?"}], "label": w}
            for c, w in [("Oslo", "snow"), ("Rome", "hot")]]
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir, saved = tmp_path / "run", tmp_path / "rollouts"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(agent_dir),
           "--prompt-data", str(data), "--num-rollout", "1", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "64",
           "--rollout-temperature", "0.1", "--global-batch-size", "4",
           "--engine-max-total-tokens", "8192", "--run-dir", str(run_dir),
           "--agent-function-path", "milepost.testing.agent_harness:forking_weather_agent_fn",
           "--session-model-family", "qwen3", "--session-mode", "branching",
           "--session-leaf-selection", "all", "--save-rollouts", str(saved),
           "--reward-fn", "milepost.rollout.layers:agent_reward"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    groups = load_rollout(saved, 0)
    samples = [s for g in groups for s in g]
    assert len(groups) == 2 and len(samples) > 4  # more sequences than trajectories
    for g in groups:
        assert [s.index for s in g] == list(range(len(g)))
        assert {s.metadata["trajectory"] for s in g} == {0, 1}
        for k in (0, 1):  # each trajectory's sequences are distinct leaves sharing its reward
            mine = [s for s in g if s.metadata["trajectory"] == k]
            assert len({s.metadata["leaf_turn"] for s in mine}) == len(mine)
            assert mine[0].metadata["leaves_selected"] == len(mine)
            assert len({s.reward for s in mine}) == 1
    (m,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "train/loss" in m and m["train/padding_samples"] == -len(samples) % 4


@pytest.mark.parametrize("forking", [False, True], ids=["linear", "branching-all-leaves"])
def test_agent_fn_under_fully_async(agent_dir, tmp_path, forking):
    """The agent layer and the session server under --fully-async: the rollout worker runs each
    trajectory through the agent fn while the trainer trains, and every step trains groups of
    session sequences scored by the agent's grade. Linear: in-place updates, tool results stay
    untrained. Branching with every leaf selected: a trajectory yields
    several sequences and the step is filled to whole optimizer steps."""
    rows = [{"prompt": [{"role": "user", "content": f"Weather in {c}?"}], "label": w}
            for c, w in [("Oslo", "snow"), ("Rome", "hot"), ("Lima", "mild"), ("Bern", "snow")]]
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    agent = "forking_weather_agent_fn" if forking else "weather_agent_fn"
    cmd = [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(agent_dir),
           "--prompt-data", str(data), "--num-rollout", "3", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "2", "--rollout-max-response-len", "64",
           "--engine-max-total-tokens", "8192", "--run-dir", str(run_dir), "--fully-async",
           "--pause-generation-mode", "in_place", "--global-batch-size", "4",
           "--agent-function-path", f"milepost.testing.agent_harness:{agent}",
           "--session-model-family", "qwen3"]  # no reward fn: the agent's grade stands
    if forking:
        cmd += ["--session-mode", "branching", "--session-leaf-selection", "all"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert all("train/loss" in m and "rollout/fully_async/inflight_mean" in m for m in lines)
    accounts = json.loads((run_dir / "fully_async_accounting.json").read_text())
    assert accounts["prompts_trained"] == 3 * 2
    for m in lines:
        assert m["rollout/num_groups"] == 2 and m["rollout/reward_errors"] == 0
    if forking:  # several leaves per trajectory reach the trainer; the step is filled
        assert all(m["train/padding_samples"] == -m["rollout/num_samples"] % 4 for m in lines)
        assert max(m["rollout/num_samples"] for m in lines) > 4
        return
    for m in lines:
        assert m["rollout/num_samples"] == 4
        # Session sequences: tool results and template glue in the response are not trained on
        # (a plain completion trains every response token).
        assert m["train/loss_tokens"] < m["rollout/num_samples"] * m["rollout/response_len_mean"]
    # Whether an update lands mid-session here is timing (a whole episode often fits between
    # two updates: a CI run saw none in 3 steps); in-place updates reaching trajectories
    # mid-generation are checked where generation is made the slow side
    # (test_fully_async.py::test_in_place_updates_reach_trajectories_mid_generation).
    assert all(0 <= m["rollout/fully_async/mixed_version_frac"] <= 1 for m in lines)
