"""[opd] settings: refusals naming the settings, derived opd_coef, [[opd.teachers]] round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config


def _model(d: Path, model_type: str = "qwen3", vocab: int = 64) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": vocab}))
    return d


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(_model(tmp_path / "student")), "--prompt-data", str(prompts),
            "--num-rollout", "2", "--rollout-batch-size", "2", "--device", "cpu",
            "--run-dir", str(tmp_path / "run")]


def test_defaults_off_and_coef_resolved_with_a_teacher(base: list[str]) -> None:
    assert load_config(None, base).opd_coef is None
    cfg = load_config(None, base + ["--opd-teacher-url", "http://127.0.0.1:9"])
    assert cfg.opd_coef == 1.0 and cfg.opd_top_k == 0


@pytest.mark.parametrize("extra, needles", [
    (["--opd-coef", "0.5"], ["--opd-coef 0.5 needs a teacher"]),
    (["--opd-top-k", "4"], ["--opd-top-k 4 needs a served teacher"]),
    (["--opd-teacher-url", "127.0.0.1:9"], ["not an http(s)://host:port"]),
    (["--opd-teacher-url", "http://127.0.0.1:9", "--opd-teacher-checkpoint", "TEACHER"],
     ["--opd-teacher-url and --opd-teacher-checkpoint are given together"]),
    (["--opd-teacher-checkpoint", "TEACHER", "--opd-top-k", "2"], ["served teacher only"]),
    (["--opd-teacher-checkpoint", "OTHER"], ["model_type 'llama'", "vocab_size 32"]),
    (["--opd-teacher-url", "http://127.0.0.1:9", "--rollout-only"], ["--rollout-only"]),
    (["--opd-teachers", '[{"url": "http://a:1", "tag": "m"}, {"url": "http://b:1", "tag": "m"}]'],
     ["tags ['m'] are given twice"]),
    (["--opd-teachers", '[{"url": "http://a:1"}]'], ["needs exactly url and tag"]),
])
def test_refusals(base: list[str], tmp_path: Path, extra: list[str], needles: list[str]) -> None:
    _model(tmp_path / "teacher")
    _model(tmp_path / "other", "llama", 32)
    extra = [{"TEACHER": str(tmp_path / "teacher"), "OTHER": str(tmp_path / "other")}.get(x, x)
             for x in extra]
    with pytest.raises(ConfigError) as err:
        load_config(None, base + extra)
    for needle in needles:
        assert needle in str(err.value)


def test_teachers_table_round_trips_through_the_resolved_config(base: list[str], tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text('[opd]\nopd_coef = 0.25\n[[opd.teachers]]\nurl = "http://127.0.0.1:7"\n'
                      'tag = "math"\n[[opd.teachers]]\nurl = "http://127.0.0.1:8"\ntag = "code"\n')
    cfg = load_config(recipe, base)
    assert cfg.teachers == [{"url": "http://127.0.0.1:7", "tag": "math"},
                            {"url": "http://127.0.0.1:8", "tag": "code"}]
    again = load_config(cfg.write_resolved())
    assert again.teachers == cfg.teachers and again.opd_coef == 0.25


def test_in_process_teacher_path_is_absolute(base: list[str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    _model(tmp_path / "teacher")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, base + ["--opd-teacher-checkpoint", "teacher"])
    assert cfg.opd_teacher_checkpoint == tmp_path / "teacher"
