"""Leaf selection of branching sessions (--session-leaf-selection): the built-ins and a user
selector on a real session tree, the contract check, grouping of several sequences per
trajectory, the zero-weight filling of a step, and the start-up refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from milepost.config import load_config
from milepost.rollout.agentic import pad_to_optimizer_steps
from milepost.rollout.layers import LayerContractError, as_samples, number_group
from milepost.session.matchers import load_matcher
from milepost.session.selection import (
    LeafSelectionError,
    load_leaf_selector,
    select_leaves,
)
from milepost.session.sequence import build_samples
from milepost.session.store import Session
from milepost.train.advantages import AdvantageSettings, grpo
from milepost.types import Sample


def _tree() -> Session:
    """root -> t1 -> t2 (leaf), root -> t3 (leaf, a fork), t1 -> t4 (leaf, newest)."""
    s = Session("s", "branching", load_matcher("strict"))
    user = {"role": "user", "content": "q"}

    def add(at, reply: str, extra: list) -> object:
        msgs = at.messages + extra + [{"role": "assistant", "content": reply}]
        return s.add_turn(at, msgs, None, prompt_ids=[1, 2], output_ids=[3, 4],
                          logprobs=[-0.1, -0.2], weight_versions=["0", "0"],
                          finish_reason={"type": "stop"})

    t1 = add(s.root, "a", [user])
    add(t1, "b", [{"role": "user", "content": "more"}])
    add(s.root, "c", [user])
    add(t1, "d", [{"role": "user", "content": "other"}])
    return s


def pick_longest(samples: list[Sample]) -> list[Sample]:
    return [max(samples, key=lambda s: len(s.tokens))]


def test_builtin_and_user_selections_on_a_real_tree() -> None:
    samples = build_samples(_tree())
    assert [s.metadata["leaf_turn"] for s in samples] == [2, 3, 4]
    assert [s.metadata["leaf_turn"] for s in select_leaves(load_leaf_selector("all"), samples)
            ] == [2, 3, 4]
    (latest,) = select_leaves(load_leaf_selector("latest"), samples)
    assert latest.metadata["leaf_turn"] == 4
    user = load_leaf_selector(f"{__name__}:pick_longest")
    (longest,) = select_leaves(user, samples)
    assert longest.metadata["turns"] == 2


def test_a_selector_that_breaks_its_contract_is_named() -> None:
    samples = build_samples(_tree())
    with pytest.raises(LeafSelectionError, match="chose no leaf"):
        select_leaves(lambda s: [], samples)
    with pytest.raises(LeafSelectionError, match="samples it was given"):
        select_leaves(lambda s: [Sample.from_dict(s[0].to_dict())], samples)
    with pytest.raises(ValueError, match="--session-leaf-selection"):
        load_leaf_selector("no.such.module:fn")


def test_sequences_of_several_trajectories_form_one_group() -> None:
    def seq(k: int) -> Sample:
        return Sample(group_index=7, index=k, tokens=[1, 2, 3], response_length=2)

    group = number_group([as_samples([seq(0), seq(0)]), as_samples(seq(1))])
    assert [s.index for s in group] == [0, 1, 2]
    assert [s.metadata["trajectory"] for s in group] == [0, 0, 1]
    with pytest.raises(LayerContractError, match="returned dict"):
        as_samples({"tokens": []})
    with pytest.raises(LayerContractError, match="empty list"):
        as_samples([])


def test_filling_a_step_adds_nothing_to_the_loss() -> None:
    real = [Sample(group_index=g, index=i, tokens=[1, 2, 3, 4], response_length=2,
                   loss_mask=[1, 1], rollout_logprobs=[-0.5, -0.5], reward=float(i))
            for g in (0, 1) for i in range(3)]  # 6 sequences, optimizer steps of 4
    padded = pad_to_optimizer_steps(real, 4)
    assert len(padded) == 8 and padded[:6] == real
    fill = padded[6:]
    assert all(sum(s.loss_mask) == 0 and s.reward == 0.0 for s in fill)
    assert len({s.group_index for s in padded}) == 4  # each filler alone in its group
    adv = grpo(padded, AdvantageSettings())
    assert torch.equal(torch.stack(adv[:6]), torch.stack(grpo(real, AdvantageSettings())))
    assert all(float(a.abs().sum()) == 0.0 for a in adv[6:])
    assert pad_to_optimizer_steps(real, 3) == real


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "label": "x"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--num-rollout", "1",
            "--rollout-batch-size", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run"),
            "--agent-function-path", "my.agent:run", "--session-model-family", "qwen3"]


@pytest.mark.parametrize("flags,needle", [
    (["--session-leaf-selection", "some"], "neither"),
    (["--session-leaf-selection", "all"], "linear session"),
    (["--session-leaf-selection", "all", "--session-mode", "branching",
      "--advantage-estimator", "gspo"], "sequence_mean"),
])
def test_bad_selections_are_refused_at_start(base, flags, needle) -> None:
    with pytest.raises(Exception) as e:
        load_config(None, base + flags)
    assert needle in str(e.value)


def test_selection_all_with_branching_is_accepted(base) -> None:
    cfg = load_config(None, base + ["--session-leaf-selection", "all",
                                    "--session-mode", "branching"])
    assert cfg.session_leaf_selection == "all"
    assert load_config(None, base).session_leaf_selection == "latest"
