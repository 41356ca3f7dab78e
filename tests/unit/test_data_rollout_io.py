"""save_rollout / load_rollout: exact round trip, atomic writes, clear errors."""

from __future__ import annotations

import json

import pytest

from milepost.data.rollout_io import load_rollout, rollout_path, save_rollout
from milepost.types import Sample, Status


def groups() -> list[list[Sample]]:
    return [[Sample(group_index=g, index=k, tokens=[1, 2, 3, 10 + k], response_length=1,
                    prompt=[{"role": "user", "content": "hi"}], response="x", label=str(g),
                    loss_mask=[1], rollout_logprobs=[-0.25], weight_versions=["4"], reward=0.5 * k,
                    status=Status.TRUNCATED if k else Status.COMPLETED,
                    metadata={"finish_reason": {"type": "stop"}, "prompt_index": g})
             for k in range(2)] for g in range(3)]


def test_round_trip_is_exact_and_atomic(tmp_path):
    saved = groups()
    path = save_rollout(tmp_path / "r", 12, saved)
    assert path == rollout_path(tmp_path / "r", 12) and path.name == "rollout_000012.jsonl"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    back = load_rollout(tmp_path / "r", 12)
    assert [[s.to_dict() for s in g] for g in back] == [[s.to_dict() for s in g] for g in saved]
    assert back[1][1].status is Status.TRUNCATED and back[1][1].tokens == [1, 2, 3, 11]


def test_errors(tmp_path):
    saved = groups()
    path = save_rollout(tmp_path / "r", 12, saved)
    saved[0][0].metadata["obj"] = object()
    with pytest.raises(TypeError, match="group 0 of step 13 is not JSON serializable"):
        save_rollout(tmp_path / "r", 13, saved)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # nothing half-written
    with pytest.raises(FileNotFoundError, match="no saved rollout for step 13"):
        load_rollout(tmp_path / "r", 13)
    path.write_text(json.dumps([{"nope": 1}]) + "\n")
    with pytest.raises(ValueError, match="line 1: not a saved group"):
        load_rollout(tmp_path / "r", 12)
