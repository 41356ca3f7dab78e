"""`milepost train --hf-checkpoint FP8_DIR` end to end on CPU: an RL run starting from an FP8
blockwise checkpoint (milepost's own conversion). The trainer dequantizes it at load; the
engines serve it as the contract says (bf16 run: dequantized; FP8 run: the checkpoint's own
float8 values, which the FP8 trainer's quantizer gives back bit for bit), every update checked
(`--check-weight-update-equal`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from milepost.lowprec.contract import Contract
from milepost.lowprec.convert import convert_checkpoint
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.lowprec_runs import two_step_gaps


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fp8ckpt_run")
    make_tiny_checkpoint(root / "bf16", "qwen3", seed=5)
    convert_checkpoint(root / "bf16", root / "fp8", Contract("fp8_block", "fp8_block"))
    rows = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4)]]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_rl_run_starts_from_an_fp8_checkpoint(work: Path, precision: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    gaps = two_step_gaps(work / "fp8", work / "prompts.jsonl", run_dir, "--precision", precision)
    # Step 1's rollout ran on the checkpoint as loaded: the same values on both sides (fp32).
    assert gaps[0] < 1e-4, gaps
    # The trained weights are exported unquantized: the FP8 layout's config must not follow.
    assert "quantization_config" not in json.loads((run_dir / "hf" / "config.json").read_text())


def test_serve_an_fp8_checkpoint_over_http(work: Path, tmp_path: Path) -> None:
    """`milepost serve --model-path FP8_DIR`: fp8_block from the checkpoint, no flag; greedy
    tokens and log-probs equal a server quantizing the bf16 source on load; a layout the engines
    cannot hold stops the process at start naming the setting."""
    import httpx

    from milepost.testing.server_process import ServerProcess

    body = {"input_ids": [5, 6, 7, 8, 9, 10], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
    results = []
    for path, flags in ((work / "fp8", ()), (work / "bf16", ("--quantization", "fp8_block"))):
        with ServerProcess(path, "--device", "cpu", "--max-total-tokens", "256", *flags) as srv:
            info = httpx.get(f"{srv.url}/get_server_info", timeout=30).json()
            assert info["quantization"] == "fp8_block"
            out = httpx.post(f"{srv.url}/generate", json=body, timeout=60).json()
            results.append((out["output_ids"], out["meta_info"]["output_token_logprobs"]))
    assert results[0] == results[1]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (work / "fp8").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [1, 128]
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "milepost", "serve", "--model-path", str(bad),
                           "--device", "cpu"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "weight_block_size is [1, 128]" in proc.stdout + proc.stderr
