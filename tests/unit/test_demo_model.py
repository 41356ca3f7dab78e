"""The demo's base-model builder at toy size: a loadable HF directory, deterministic, phases that end
on held-out checks, a clear error when a phase misses its target, budget enforced."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from milepost.demo.base_model import INFO_FILE, DemoModelError, DemoModelRecipe, batches, make_demo_model
from milepost.demo.prepare import main, prepare
from milepost.demo.task import read_jsonl
from milepost.models.registry import load_model

# Targets a toy model meets at once (every check passes), so each phase ends at its first check.
TOY = DemoModelRecipe(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64,
    batch_size=8, warmup_steps=2, eval_problems=16, check_every=2, drill_target=0.0,
    max_drill_steps=6, min_tutor_steps=3, max_tutor_steps=6, exact_band=(0.0, 1.0),
    min_computing_accuracy=0.0,
)


def _build(path, recipe=TOY):
    return make_demo_model(path, seconds_budget=None, recipe=recipe, threads=None)


def test_builds_a_loadable_checkpoint_and_records_the_phases(tmp_path):
    out = _build(tmp_path / "m")
    info = json.loads((out / INFO_FILE).read_text())
    # Drills end at the first check (step 2); the tutor phase at the first check after 3 steps.
    assert info["drill_steps"] == 2 and info["tutor_steps"] == 4
    assert [(c["phase"], c["step"]) for c in info["checks"]] == [("drills", 2), ("tutor", 2), ("tutor", 4)]
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
    # Every step changes the weights: a tutor phase that must run longer gives other weights.
    wc = load_file(_build(tmp_path / "c", replace(TOY, min_tutor_steps=5)) / "model.safetensors")
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_initialization_is_our_own_and_seeded(tmp_path):
    """The start does not depend on transformers' init functions: norms 1, matrices N(0, range)."""
    recipe = replace(TOY, max_drill_steps=1, drill_target=2.0)  # fails after one step: weights unsaved
    with pytest.raises(DemoModelError):
        _build(tmp_path / "m", recipe)
    from transformers import Qwen3ForCausalLM

    from milepost.demo.base_model import _init_weights

    model = Qwen3ForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    _init_weights(model, TOY)
    w = dict(model.named_parameters())
    assert torch.equal(w["model.norm.weight"], torch.ones_like(w["model.norm.weight"]))
    emb = w["model.embed_tokens.weight"]
    assert abs(emb.std().item() - TOY.initializer_range) < 0.002
    _init_weights(model, TOY)
    assert torch.equal(emb, dict(model.named_parameters())["model.embed_tokens.weight"])


def test_batches_are_drills_then_the_tutors_answers():
    drills, tutor = next(batches(TOY, "drills")), next(batches(TOY, "tutor"))
    assert len(drills) == len(tutor) == 8
    assert all(r["response"] == str(eval(r["prompt"][:-1])) for r in drills)
    assert next(batches(TOY, "tutor")) == tutor  # a pure function of the seed
    many = [r for _, b in zip(range(50), batches(TOY, "tutor")) for r in b]
    share = sum(r["response"].startswith("~") for r in many) / len(many)
    assert abs(share - (1 - TOY.teacher_accuracy)) < 0.08


@pytest.mark.parametrize("field, value, phase", [
    ("drill_target", 2.0, "drills phase"),  # can never be reached
    ("exact_band", (2.0, 3.0), "tutor phase"),
    ("min_computing_accuracy", 2.0, "tutor phase"),
])
def test_a_missed_target_fails_loudly_naming_it(tmp_path, field, value, phase):
    with pytest.raises(DemoModelError, match=f"{phase} missed its target.*{field}="):
        _build(tmp_path / "m", replace(TOY, **{field: value}))


def test_seconds_budget_is_enforced(tmp_path):
    with pytest.raises(TimeoutError, match="seconds_budget"):
        make_demo_model(tmp_path / "m", seconds_budget=1e-9, recipe=TOY, threads=None)


def test_prepare_writes_everything_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setattr("milepost.demo.prepare.DemoModelRecipe", lambda seed: replace(TOY, seed=seed))
    model_dir, prompts = prepare(tmp_path, seconds_budget=None)
    assert (model_dir / "model.safetensors").exists() and (model_dir / "tokenizer.json").exists()
    assert len(read_jsonl(prompts)) > 0 and len(read_jsonl(tmp_path / "eval_prompts.jsonl")) == 256
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare(tmp_path, seconds_budget=None) == (model_dir, prompts)
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_prepare_cli_exits_1_with_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("milepost.demo.prepare.DemoModelRecipe",
                        lambda seed: replace(TOY, seed=seed, drill_target=2.0))
    assert main([str(tmp_path), "--seconds-budget", "0"]) == 1
    assert "drills phase missed its target" in capsys.readouterr().err
    assert not (tmp_path / "prepare.json").exists()
