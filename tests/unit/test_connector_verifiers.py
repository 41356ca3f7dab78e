"""The Verifiers connector without a model: prompts from a real verifiers environment, and
episodes whose environment raises, hangs or grades badly end failed with the reason."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from milepost.connectors.episodes import ERROR_KEY, env_reward, run_episode
from milepost.data.source import PromptItem
from milepost.rollout.layers import AgentContext
from milepost.types import Sample

pytest.importorskip("verifiers", reason="needs milepost[verifiers]")
from milepost.connectors import verifiers_env as vfc  # after the skip

ENV_SOURCE = textwrap.dedent('''
    import asyncio
    import verifiers as vf
    from datasets import Dataset

    class Broken(vf.SingleTurnEnv):
        async def setup_state(self, state):
            if state["info"]["mode"] == "setup_raises":
                raise RuntimeError("setup broke on purpose")
            if state["info"]["mode"] == "setup_hangs":
                await asyncio.sleep(3600)
            return state

    def right(completion, answer, **kwargs):
        return float(answer in str(completion))

    def load_environment(modes=("ok",)):
        rows = [{"question": f"q{i}", "answer": str(i), "info": {"mode": m}}
                for i, m in enumerate(modes)]
        return Broken(dataset=Dataset.from_list(rows), system_prompt="Answer briefly.",
                      rubric=vf.Rubric(funcs=[right]))
''')


@pytest.fixture
def env_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"broken_env_{tmp_path.name}"  # unique: each test loads it afresh
    (tmp_path / f"{name}.py").write_text(ENV_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_rows_carry_the_environment_input(env_module: str) -> None:
    rows = vfc.prompt_rows(env_module, size=3, seed=0, args={"modes": ["ok", "ok", "ok", "ok"]},
                           timeout_s=7)
    assert len(rows) == 3
    for row in rows:
        meta = row["metadata"]["verifiers"]
        assert meta["env"] == env_module and meta["timeout_s"] == 7
        assert row["prompt"][0] == {"role": "system", "content": "Answer briefly."}
        assert row["prompt"] == meta["input"]["prompt"] and row["label"] == meta["input"]["answer"]
    assert rows == vfc.prompt_rows(env_module, size=3, seed=0, args={"modes": ["ok"] * 4},
                                   timeout_s=7)
    assert len(vfc.prompt_rows(env_module, size=50, seed=0)) == 1  # never more than it has


def test_unknown_environment_is_named() -> None:
    with pytest.raises(ValueError, match="no_such_vf_env"):
        vfc.prompt_rows("no_such_vf_env", size=1, seed=0)


def _episode(env_module: str, mode: str, timeout_s: float) -> dict:
    (row,) = vfc.prompt_rows(env_module, size=1, seed=0, args={"modes": [mode]},
                             timeout_s=timeout_s)

    async def go() -> dict:
        async with httpx.AsyncClient() as http:
            item = PromptItem(index=0, prompt=row["prompt"], prompt_ids=[1], label=row["label"],
                              metadata=row["metadata"])
            # No model is reached: each of these environments fails before its first call.
            ctx = AgentContext("http://127.0.0.1:9/v1", item, 0, http, 8)
            out = await vfc.agent(ctx)
        assert out.reward is None
        return out.metadata

    return asyncio.run(go())


def test_an_environment_that_raises_or_hangs_fails_its_episode(env_module: str) -> None:
    meta = _episode(env_module, "setup_raises", timeout_s=30)
    assert "setup broke on purpose" in meta[ERROR_KEY]
    meta = _episode(env_module, "setup_hangs", timeout_s=0.5)
    assert "no result within 0.5 s" in meta[ERROR_KEY]
    s = Sample(group_index=0, index=0, tokens=[1], response_length=0, metadata=meta)
    with pytest.raises(RuntimeError, match="no result within"):
        env_reward(s)


@pytest.mark.parametrize("reward", [math.nan, math.inf, "1.0", None, True])
def test_a_malformed_reward_fails_the_episode(reward: object) -> None:
    async def episode() -> tuple[object, dict]:
        return reward, {"seen": 1}

    out = asyncio.run(run_episode(episode(), timeout_s=5, what="env:x"))
    assert out.reward is None and out.metadata["seen"] == 1
    assert out.metadata[ERROR_KEY].startswith("env:x: malformed reward")


def test_a_good_reward_is_kept_and_trained_on() -> None:
    async def episode() -> tuple[object, dict]:
        return 1, {}

    out = asyncio.run(run_episode(episode(), timeout_s=5, what="env:x"))
    assert out.reward == 1.0 and ERROR_KEY not in out.metadata
    s = Sample(group_index=0, index=0, tokens=[1], response_length=0,
               metadata={"agent_reward": out.reward})
    assert env_reward(s) == 1.0


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.delitem(sys.modules, "milepost.connectors.verifiers_env")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"pip install 'milepost\[verifiers\]'"):
        importlib.import_module("milepost.connectors.verifiers_env")
