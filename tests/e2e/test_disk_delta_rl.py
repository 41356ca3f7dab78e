"""Disk-delta after real RL steps (`milepost train`, CPU, real processes).

The run publishes a full base at the first update, then one delta per RL step, and reports the
fraction of bytes changed; `--check-weight-update-equal` proves the engine holds the trainer's
weights after the first update. Then a fresh engine replays the run's store: versions in order
are accepted, an XOR version applied twice and a version on the wrong base are refused with a
message, and the engine keeps serving the weights it had. Two models: a tiny random Qwen3 with a
reward that varies within groups (default suite), and the demo model on its task (slow: the
session's shared `demo_dir`, built once for every demo test; opt-in, `-m optin`: the tiny case
covers the same path in the default suite).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.weights.disk_delta import published_versions, read_index

ROOT = Path(__file__).resolve().parents[2]
REWARD = '''
def parity(sample):
    # Deterministic 0/1 rewards that differ within a group, so a GRPO step moves the weights.
    return float(sum(sample.response_ids) % 2)
'''
TINY_ROWS = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in
             [(1, 2), (3, 4), (5, 6), (7, 8)]]


def tiny_run(tmp: Path) -> tuple[Path, list[str], dict]:
    model = make_tiny_checkpoint(tmp / "qwen3", "qwen3", seed=3)
    (tmp / "rewards").mkdir()
    (tmp / "rewards" / "delta_rewards.py").write_text(REWARD)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in TINY_ROWS))
    recipe = tmp / "tiny.toml"
    recipe.write_text(f'[model]\nhf_checkpoint = "{model}"\n[data]\nprompt_data = "{prompts}"\n')
    args = [str(recipe), "--reward-fn", "delta_rewards:parity", "--rollout-batch-size", "2",
            # 8 samples: a group whose parities all agree (no gradient) has odds 2 / 2**8, and a
            # step trains nothing only if both groups agree (4 samples made that 1 in 64 per step)
            "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8", "--lr", "1e-3",
            "--engine-max-total-tokens", "2048"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp / "rewards"), os.environ.get("PYTHONPATH", "")])}
    return model, args, env


def demo_run(work: Path) -> tuple[Path, list[str], dict]:
    args = [str(ROOT / "recipes" / "tiny_demo.toml"), "--hf-checkpoint", str(work / "base_model"),
            "--prompt-data", str(work / "rl_prompts.jsonl"),
            "--eval-prompt-data", str(work / "eval_prompts.jsonl"),
            "--rollout-batch-size", "8", "--global-batch-size", "64"]
    return work / "base_model", args, {**os.environ}


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def generate(url: str) -> dict:
    r = post(url, "/generate", {"input_ids": [[5, 6, 7, 8]], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()[0]


@pytest.mark.parametrize("source", ["tiny", pytest.param("demo", marks=pytest.mark.optin)])
def test_disk_delta_after_real_rl_steps(tmp_path: Path, source: str, request: pytest.FixtureRequest) -> None:
    # The demo's base model is the session's (tests/e2e/conftest.py gives this case its time limit).
    model, args, env = tiny_run(tmp_path) if source == "tiny" else demo_run(request.getfixturevalue("demo_dir"))
    run_dir = tmp_path / "rl"
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", *args, "--run-dir", str(run_dir),
         "--num-rollout", "3", "--save-hf-at-end", "false",
         "--update-weight-transfer-mode", "disk-delta", "--check-weight-update-equal"],
        timeout=900, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    fractions = [r["perf/update_weights_delta_changed_fraction"] for r in records]
    written = [r["perf/update_weights_delta_bytes_written"] for r in records]
    total = records[0]["perf/update_weights_bytes"]
    grad = [r["train/grad_norm"] for r in records]
    assert fractions[0] == 1.0  # the base: every byte
    assert all(g > 0 for g in grad[1:]), grad  # the steps did train
    assert all(0 < f < 1 for f in fractions[1:]), fractions  # an RL step changes some bytes
    assert all(w < total for w in written[1:]), (written, total)
    print(f"\n{source}: changed fractions per update {fractions}; bytes written {written} "
          f"of {total}")

    store = run_dir / "weight_deltas"
    assert published_versions(store) == [0, 1, 2]
    assert read_index(store, 1).encoding == "xor" and read_index(store, 1).base_version == 0
    with ServerProcess(model, "--max-total-tokens", "1024") as srv:
        url = srv.url
        # Wrong base: this engine holds no version yet, delta 1 needs version 0.
        r = post(url, "/weights_delta/prepare", {"root": str(store), "version": 1})
        assert r.status_code == 400 and "holds no version" in r.json()["message"]
        assert generate(url)["meta_info"]["weight_version"] == "default"
        for v in (0, 1):
            assert post(url, "/weights_delta/prepare", {"root": str(store), "version": v}
                        ).status_code == 200
            assert post(url, "/weights_delta/commit", {"version": v}).status_code == 200
        served = generate(url)
        assert served["meta_info"]["weight_version"] == "2"
        # XOR twice: refused; weights and version unchanged.
        r = post(url, "/weights_delta/prepare", {"root": str(store), "version": 1})
        assert r.status_code == 400 and "exactly once" in r.json()["message"]
        r = post(url, "/weights_delta/commit", {"version": 1})
        assert r.status_code == 400 and "prepared nothing" in r.json()["message"]
        again = generate(url)
        assert again["output_ids"] == served["output_ids"]
        assert again["meta_info"]["weight_version"] == "2"


def test_p2p_in_a_real_run_passes_both_checks(tmp_path: Path) -> None:
    """`--update-weight-transfer-mode p2p` in `milepost train` with 2 trainer ranks and 2 engines:
    each rank sends to its own engine (report 4.2); the equality check at the first update and
    the digest check after every update both pass."""
    _, args, env = tiny_run(tmp_path)
    run_dir = tmp_path / "rl"
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", *args, "--run-dir", str(run_dir),
         "--num-rollout", "2", "--save-hf-at-end", "false", "--update-weight-buffer-size",
         str(1 << 20), "--update-weight-transfer-mode", "p2p", "--check-weight-update-equal",
         "--check-weight-update", "--actor-num-gpus-per-node", "2", "--rollout-num-engines", "2"],
        timeout=900, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert len(records) == 2 and all(r["perf/update_weights_bytes"] > 0 for r in records)


def test_fp8_engines_in_a_real_run_pass_both_checks(tmp_path: Path) -> None:
    """`--engine-quantization fp8`: engines store projections in fp8 and quantize every update;
    the equality check (noise first) and the per-update check pass within the format's bound."""
    _, args, env = tiny_run(tmp_path)
    run_dir = tmp_path / "rl"
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", *args, "--run-dir", str(run_dir),
         "--num-rollout", "2", "--save-hf-at-end", "false", "--engine-quantization", "fp8",
         "--check-weight-update-equal", "--check-weight-update"],
        timeout=900, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert len(records) == 2 and all(r["perf/update_weights_bytes"] > 0 for r in records)


def test_disk_delta_under_fully_async(tmp_path: Path) -> None:
    """Under `--fully-async` disk-delta writes and prepares while the engines generate and pauses
    them only around the reload; every step still gets a version the engines verifiably hold.
    The first update, which fills the engines with noise for the equality check, pauses them
    around it all: nothing is generated from the noise (its tokens, tagged "randomized", once
    reached the buffer and stopped the run)."""
    _, args, env = tiny_run(tmp_path)
    run_dir = tmp_path / "rl"
    done = subprocess.run(
        [sys.executable, "-m", "milepost", "train", *args, "--run-dir", str(run_dir),
         "--num-rollout", "3", "--save-hf-at-end", "false", "--fully-async",
         "--update-weight-transfer-mode", "disk-delta", "--check-weight-update-equal",
         "--check-weight-update"],
        timeout=900, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["perf/update_weights_delta_version"] for r in records] == [0, 1, 2]
    assert ["perf/generation_pause_time" in r for r in records] == [True, False, False]
