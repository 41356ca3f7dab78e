"""`milepost models` tells the truth: its table agrees with the registry, the tests it cites exist,
the docs (docs/models.md) carry the generated table, and `--check` names the path a checkpoint takes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from milepost.models.registry import MODEL_REGISTRY
from milepost.models.support import ARCHS, FALLBACK, NATIVE, has_native_routing, markdown_table
from milepost.testing.hf_archs import TINY_ARCHS, make_tiny_hf_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def test_table_agrees_with_the_registry_and_cites_real_tests() -> None:
    tiny = {model for _, model, _ in TINY_ARCHS.values()}
    for a in ARCHS:
        assert (a.name in MODEL_REGISTRY) == (a.path == NATIVE), a.name
        if a.path == FALLBACK:
            assert a.name in tiny, f"{a.name}: a fallback row needs a tiny checkpoint in its tests"
        assert a.tests and all((ROOT / t).is_file() for t in a.tests), a.name
    assert set(MODEL_REGISTRY) <= {a.name for a in ARCHS}
    assert has_native_routing("Qwen3MoeForCausalLM") and has_native_routing("GptOssForCausalLM")
    assert not has_native_routing("MixtralForCausalLM")  # no native path: the fallback records no routing


def test_docs_carry_the_generated_table() -> None:
    table = markdown_table()
    assert table in (ROOT / "docs" / "models.md").read_text()


def test_models_check_names_the_path(tmp_path: Path, capsys) -> None:
    from milepost.cli import build_parser

    phi = make_tiny_hf_checkpoint(tmp_path / "p", "phi3", num_hidden_layers=2)
    qwen2 = make_tiny_hf_checkpoint(tmp_path / "q", "qwen2_full", num_hidden_layers=1)
    out = {}
    for name, path in (("phi", phi), ("qwen2", qwen2)):
        ns = build_parser().parse_args(["models", "--check", str(path)])
        assert ns.run(ns) == 0
        out[name] = capsys.readouterr().out
    assert "Phi3ForCausalLM: transformers (exact, slower), because: architecture 'Phi3ForCausalLM' " \
           "has no native definition" in out["phi"]
    assert out["qwen2"].strip().endswith("Qwen2ForCausalLM: native")


def test_models_command_prints_the_table(capsys) -> None:
    r = subprocess.run([sys.executable, "-m", "milepost", "models", "--markdown"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == markdown_table()


def test_train_refuses_what_the_fallback_cannot_do(tmp_path: Path) -> None:
    import json

    import pytest

    from milepost.config import ConfigError, load_config

    model = tmp_path / "mixtral"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 4,
                                                   "architectures": ["MixtralForCausalLM"]}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    flags = ["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--num-rollout", "2",
             "--rollout-batch-size", "4", "--device", "cpu", "--run-dir", str(tmp_path / "run")]
    load_config(None, flags)
    with pytest.raises(ConfigError, match="--use-rollout-routing-replay.*transformers fallback"):
        load_config(None, [*flags, "--use-rollout-routing-replay"])
    with pytest.raises(ConfigError, match="--engine-quantization fp8 needs a native model; MixtralForCausalLM"):
        load_config(None, [*flags, "--engine-quantization", "fp8"])
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                                   "auto_map": {"AutoModelForCausalLM": "m.X"}}))
    with pytest.raises(ConfigError, match="auto_map.*milepost train does not run custom code"):
        load_config(None, flags)
