"""The smallest `milepost train` command line config tests load: a stub qwen3 checkpoint
directory (config.json only: config loading reads no weights) and a one-row prompt file."""

from __future__ import annotations

import json
from pathlib import Path


def stub_run_args(tmp_path: Path, *extra: str) -> list[str]:
    """`--hf-checkpoint`, `--prompt-data` and `--run-dir` under `tmp_path`, then `extra`."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return ["--hf-checkpoint", str(model), "--prompt-data", str(prompts),
            "--run-dir", str(tmp_path / "run"), *extra]
