"""The demo's base-model builder at toy size: a loadable HF directory, deterministic, budget enforced."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from milepost.demo.base_model import (
    INFO_FILE,
    DemoModelRecipe,
    demo_records,
    make_demo_model,
)
from milepost.demo.prepare import prepare
from milepost.demo.task import read_jsonl
from milepost.models.registry import load_model

TOY = DemoModelRecipe(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64,
    drill_steps=3, tutor_steps=2, batch_size=8, warmup_steps=2, eval_problems=16,
)


def _build(path, recipe=TOY):
    return make_demo_model(path, seconds_budget=None, recipe=recipe, threads=None)


def test_builds_a_loadable_checkpoint(tmp_path):
    out = _build(tmp_path / "m")
    info = json.loads((out / INFO_FILE).read_text())
    assert info["recipe"]["drill_steps"] == 3
    for key in ("sampled_accuracy", "greedy_accuracy", "estimate_rate", "computing_accuracy"):
        assert 0.0 <= info[key] <= 1.0 + 1e-6
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == 2
    model = load_model(out, torch.float32, "cpu")  # what `milepost serve` loads
    assert model.num_layers == 1 and model.vocab_size == 512


def test_deterministic_and_trained(tmp_path):
    wa = load_file(_build(tmp_path / "a") / "model.safetensors")
    wb = load_file(_build(tmp_path / "b") / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Every step changes the weights: one step fewer gives other weights.
    wc = load_file(_build(tmp_path / "c", replace(TOY, tutor_steps=1)) / "model.safetensors")
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_records_are_drills_then_tutor():
    drills, tutor = demo_records(TOY)
    assert len(drills) == 3 * 8 and len(tutor) == 2 * 8
    assert all(r["response"] == r["label"] for r in drills)


def test_too_little_data_is_refused(tmp_path):
    drills, tutor = demo_records(TOY)
    from milepost.demo.task import write_jsonl

    d = write_jsonl(tmp_path / "d.jsonl", drills[:5])
    t = write_jsonl(tmp_path / "t.jsonl", tutor)
    with pytest.raises(ValueError, match="needs 24 drills"):
        make_demo_model(tmp_path / "m", seconds_budget=None, recipe=TOY, data=(d, t), threads=None)


def test_seconds_budget_is_enforced(tmp_path):
    with pytest.raises(TimeoutError, match="seconds_budget"):
        make_demo_model(tmp_path / "m", seconds_budget=1e-9, recipe=TOY, threads=None)


def test_prepare_writes_everything_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setattr("milepost.demo.prepare.DemoModelRecipe", lambda seed: replace(TOY, seed=seed))
    model_dir, prompts = prepare(tmp_path, seconds_budget=None)
    assert (model_dir / "model.safetensors").exists() and (model_dir / "tokenizer.json").exists()
    assert read_jsonl(tmp_path / "drills.jsonl") == demo_records(TOY)[0]
    assert len(read_jsonl(prompts)) > 0
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare(tmp_path, seconds_budget=None) == (model_dir, prompts)
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
