"""Prompt files are checked before any engine starts: bad rows, a prompt plus the response length
beyond the model's context, an empty --eval-prompt-data; `milepost train` stops in the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.config import ConfigError, load_config
from milepost.driver.preflight import RunError, preflight
from milepost.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # max_position_embeddings 64: a short context, so a long prompt is easy to write.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pf") / "m", "qwen3",
                                max_position_embeddings=64)


def rows(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def cfg_for(model: Path, prompts: Path, tmp_path: Path, *extra: str):
    return load_config(None, ["--hf-checkpoint", str(model), "--prompt-data", str(prompts),
                              "--num-rollout", "1", "--rollout-batch-size", "1", "--device",
                              "cpu", "--run-dir", str(tmp_path / "run"), *extra])


def test_good_prompts_pass(model: Path, tmp_path: Path) -> None:
    good = rows(tmp_path / "p.jsonl", json.dumps({"prompt": "1+1=", "label": "2"}))
    preflight(cfg_for(model, good, tmp_path, "--rollout-max-response-len", "16"))


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "label": "1"', "line 2: not valid JSON"),
    ('{"text": "a", "label": "1"}', "line 2: no 'prompt' field"),
    ('{"prompt": "a"}', "line 2: no 'label' field"),
    ('{"prompt": 7, "label": "1"}', "line 2: prompt must be text"),
    ('[1, 2]', "line 2: expected an object"),
])
def test_bad_rows_are_refused_naming_the_row(model: Path, tmp_path: Path, line: str,
                                             message: str) -> None:
    bad = rows(tmp_path / "p.jsonl", json.dumps({"prompt": "ok", "label": "1"}), line)
    with pytest.raises(RunError, match=f"^--prompt-data: .*{message}"):
        preflight(cfg_for(model, bad, tmp_path))


def test_prompt_plus_response_beyond_the_context(model: Path, tmp_path: Path) -> None:
    prompts = rows(tmp_path / "p.jsonl", json.dumps({"prompt": "short", "label": "1"}),
                   json.dumps({"prompt": "a b c d e f g h i j", "label": "1"}))
    with pytest.raises(RunError, match=r"longest prompt \(row 2, \d+ tokens\) plus "
                       r"--rollout-max-response-len 60 is more than the 64 tokens.*lower "
                       r"--rollout-max-response-len to \d+"):
        preflight(cfg_for(model, prompts, tmp_path, "--rollout-max-response-len", "60"))
    evals = rows(tmp_path / "e.jsonl", json.dumps({"prompt": "a b c d e f g h i j", "label": "1"}))
    with pytest.raises(RunError, match="^--eval-prompt-data .*--eval-max-response-len 60"):
        preflight(cfg_for(model, rows(tmp_path / "s.jsonl", json.dumps(
            {"prompt": "x", "label": "1"})), tmp_path, "--rollout-max-response-len", "8",
            "--eval-prompt-data", str(evals), "--eval-max-response-len", "60",
            "--eval-interval", "1"))


def test_empty_eval_prompt_data_is_named(model: Path, tmp_path: Path) -> None:
    good = rows(tmp_path / "p.jsonl", json.dumps({"prompt": "1+1=", "label": "2"}))
    with pytest.raises(ConfigError, match="--eval-prompt-data is empty"):
        cfg_for(model, good, tmp_path, "--eval-prompt-data", "")


def test_train_stops_before_any_engine_starts(model: Path, tmp_path: Path) -> None:
    bad = rows(tmp_path / "p.jsonl", json.dumps({"prompt": "ok", "label": "1"}), '{"prompt": 1')
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "milepost", "train", "--hf-checkpoint", str(model),
         "--prompt-data", str(bad), "--num-rollout", "1", "--rollout-batch-size", "1",
         "--device", "cpu", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "line 2: not valid JSON" in out.stderr + out.stdout
    assert not list((run_dir / "logs").glob("engine-*.log"))  # no engine was started


@pytest.mark.parametrize("flags, message", [
    (["--custom-generate-function-path", "no_such_module:gen"], "--custom-generate-function-path"),
    (["--rollout-function-path", "json:no_such_fn"], "--rollout-function-path"),
])
def test_plugins_that_do_not_load_are_refused_before_engines(model: Path, tmp_path: Path,
                                                             flags: list[str],
                                                             message: str) -> None:
    good = rows(tmp_path / "p.jsonl", json.dumps({"prompt": "1+1=", "label": "2"}))
    with pytest.raises(RunError, match=message):
        preflight(cfg_for(model, good, tmp_path, *flags))
