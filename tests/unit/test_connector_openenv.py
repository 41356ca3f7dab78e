"""The OpenEnv connector's mapping between chat turns and OpenEnv observations / actions, and its
refusal of an environment that is not installed (no server process is started here)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("openenv", reason="needs milepost[openenv]")
from milepost.connectors import openenv_env as oec  # after the skip

TEXT_ACTION = {"properties": {"message": {"type": "string"}, "metadata": {"type": "object"}},
               "required": ["message"]}
MOVE_ACTION = {"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
               "required": ["x", "y"]}


def test_an_observation_with_one_text_field_is_that_text() -> None:
    assert oec.observation_text({"prompt": "Say hi.", "done": False, "reward": None,
                                 "metadata": {}}) == "Say hi."


def test_other_observations_are_their_fields_as_json() -> None:
    obs = {"board": [[0, 1]], "turn": 3, "done": False, "reward": 0.0, "metadata": {"k": 1}}
    assert json.loads(oec.observation_text(obs)) == {"board": [[0, 1]], "turn": 3}


def test_a_reply_fills_the_one_text_field_else_is_parsed_as_json() -> None:
    assert oec.action_of("hello {", TEXT_ACTION) == {"message": "hello {"}
    assert oec.action_of('{"x": 1, "y": 2}', MOVE_ACTION) == {"x": 1, "y": 2}
    for reply in ("go left", "[1, 2]"):
        with pytest.raises(ValueError, match=r"needs fields \['x', 'y'\]"):
            oec.action_of(reply, MOVE_ACTION)


def test_an_environment_that_is_not_installed_is_named() -> None:
    with pytest.raises(ValueError, match=r"no module no_such_openenv\.server\.app"):
        oec.prompt_rows("no_such_openenv", size=3, seed=10)


def test_rows_of_an_installed_environment(tmp_path, monkeypatch) -> None:
    (tmp_path / "tiny_oe" / "server").mkdir(parents=True)
    for f in ("tiny_oe/__init__.py", "tiny_oe/server/__init__.py", "tiny_oe/server/app.py"):
        (tmp_path / f).write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = oec.prompt_rows("tiny_oe", size=3, seed=10, timeout_s=9, log_dir="/x")
    assert [r["metadata"]["openenv"]["seed"] for r in rows] == [10, 11, 12]
    assert all(r["metadata"]["openenv"]["timeout_s"] == 9 for r in rows)
