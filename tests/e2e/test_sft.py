"""`milepost sft` end to end on CPU: 2 gloo ranks, loss falls, checkpoints, resume, HF export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from milepost.testing.checkpoints import make_tiny_checkpoint


def _sft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "milepost", "sft", *args], capture_output=True, text=True, timeout=300, check=False)


def test_sft_trains_resumes_and_exports(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=2)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}]}
            for a in range(10, 26)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    common = ["--hf-checkpoint", str(model), "--sft-data", str(data), "--run-dir", str(run), "--device", "cpu",
              "--global-batch-size", "8", "--lr", "3e-3", "--actor-num-gpus-per-node", "2",
              "--max-tokens-per-micro-batch", "64"]
    first = _sft(*common, "--num-epoch", "2")  # 16 conversations / 8 = 2 steps per epoch
    assert first.returncode == 0, first.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    losses = [m["train/sft_loss"] for m in metrics]
    assert losses[-1] < losses[0], losses
    assert (run / "checkpoints" / "step_00000003").is_dir() and (run / "hf" / "config.json").is_file()

    second = _sft(*common, "--num-epoch", "3")  # resumes after step 3 and runs the third epoch
    assert second.returncode == 0, second.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4, 5]
    assert metrics[-1]["data/epoch"] == 2.0
    exported = AutoModelForCausalLM.from_pretrained(run / "hf", dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(exported.state_dict()[name], original.state_dict()[name])


def test_sft_refuses_a_dataset_row_without_messages(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=2)
    data = tmp_path / "chat.jsonl"
    data.write_text('{"text": "hello"}\n')
    out = _sft("--hf-checkpoint", str(model), "--sft-data", str(data), "--run-dir", str(tmp_path / "r"),
               "--device", "cpu")
    assert out.returncode != 0
    assert "chat.jsonl:1: no 'messages' field" in out.stderr
