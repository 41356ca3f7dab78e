"""LoRA RL composed with the rest of the loop (issue 21, item 5), in real `milepost train` runs on CPU.

1. `--fully-async` with engines that store the base in fp8 (`--engine-quantization fp8`), GSPO
   and TIS: every rollout request names the adapter, each update sends the adapter alone, and the
   equality check (the engines hold the trainer's adapter) and the per-update check pass.
2. Multi-LoRA under `--fully-async` (opt-in, `-m optin`: another run): each prompt's adapter.
3. The session server with an agent fn (opt-in, `-m optin`: another run): the session server's
   engine requests name the adapter, seen in the prefix cache, which the engine never uses for
   adapter requests: hit rate 0 (the same run without LoRA: 0.68 in each of its 2 steps).
4. PPO with a critic, from saved rollouts (no engines), with the actor and the critic taking turns
   on the device and the offloaded state going to disk: the adapter, the critic's losses and the
   policy's losses come out bitwise the same as a run where everything stays resident
   (opt-in, `-m optin`: two more processes; the default suite's PPO-turns test covers full models).
5. `--colocate` (opt-in, `-m optin`: another run): the adapter crosses by in-host tensor handoff
   while the trainer is offloaded; the equality and per-update checks pass, each update the adapter
   alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from milepost.data.rollout_io import save_rollout
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.types import Sample

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj,v_proj,down_proj"]
REWARD = '''
def parity(sample):
    # 0/1 rewards that differ within a group, so each step has a gradient.
    return float(sum(sample.response_ids) % 2)


def anti_parity(sample):
    return 1.0 - parity(sample)
'''
ROWS = [{"prompt": f"What is {a} + {b}?", "label": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


def train(cmd: list[str], env: dict | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "milepost", "train", *cmd], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def parity_run_inputs(tmp_path: Path, arch: str) -> tuple[Path, Path, dict[str, str]]:
    """A tiny `arch` checkpoint, the four ROWS as prompts and the REWARD module
    `lora_compose_rewards` (parity, anti_parity): the model, the prompt file and the environment
    in which `milepost train` imports the rewards."""
    model = make_tiny_checkpoint(tmp_path / "m", arch, seed=3)
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "lora_compose_rewards.py").write_text(REWARD)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    path = os.pathsep.join([str(tmp_path / "rewards"), os.environ.get("PYTHONPATH", "")])
    return model, prompts, {"PYTHONPATH": path}


def test_fully_async_fp8_engines_gspo_tis(tmp_path: Path) -> None:
    model, prompts, env = parity_run_inputs(tmp_path, "qwen3")
    run_dir = tmp_path / "rl"
    train(["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--run-dir", str(run_dir),
           "--reward-fn", "lora_compose_rewards:parity", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8", "--lr", "1e-2",
           "--engine-max-total-tokens", "2048", "--num-rollout", "2", "--device", "cpu", *LORA,
           "--fully-async", "--engine-quantization", "fp8", "--advantage-estimator", "gspo",
           "--ratio-correction", "tis", "--check-weight-update-equal", "--check-weight-update",
           "--save-hf-at-end", "true"],
          env)
    records = metrics(run_dir)
    assert len(records) == 2
    # Each update carries the adapter alone: A [4, in] and B [out, 4] of 3 projections x 2 layers.
    adapter = load_file(str(run_dir / "hf" / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    base_bytes = (model / "model.safetensors").stat().st_size
    assert all(0 < r["perf/update_weights_bytes"] <= adapter_bytes < base_bytes / 10 for r in records)
    assert all("train/rollout_ratio" in r for r in records)  # TIS ran on every step
    assert any(t.abs().sum() > 0 for n, t in adapter.items() if "lora_B" in n)  # B starts at zero
    assert json.loads((run_dir / "hf" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.optin  # one more run (~60 s on 2 busy cores): -m optin
def test_multi_lora_fully_async(tmp_path: Path) -> None:
    """Two adapters under --fully-async: the worker's requests name each prompt's adapter, both
    train in every step (metrics per adapter), each update carries the adapters that stepped."""
    model, prompts, env = parity_run_inputs(tmp_path, "qwen3")
    adapters = [{"name": "odd", "prompt_data": str(prompts), "reward_fn": "lora_compose_rewards:parity"},
                {"name": "even", "prompt_data": str(prompts), "reward_fn": "lora_compose_rewards:anti_parity"}]
    run_dir = tmp_path / "rl"
    train(["--hf-checkpoint", str(model), "--run-dir", str(run_dir), "--lora-adapters", json.dumps(adapters),
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8",
           "--lr", "1e-2", "--engine-max-total-tokens", "2048", "--num-rollout", "2", "--device", "cpu",
           *LORA, "--fully-async", "--check-weight-update", "--save-hf-at-end", "true"],
          env)
    records = metrics(run_dir)
    assert len(records) == 2
    # The worker draws the adapters' prompts in turn; groups finish in any order, so a step's two
    # groups may be of one adapter. An engine asked for the single-LoRA name would refuse (400).
    for r in records:
        present = [n for n in ("odd", "even") if f"rollout/{n}/num_samples" in r]
        assert present and sum(r[f"rollout/{n}/num_samples"] for n in present) == 16, r
        for n, other in (("odd", "even"), ("even", "odd")):  # both rewards score each sample
            if n in present:
                assert r[f"rollout/{n}/reward_mean"] + r[f"rollout/{n}/reward_of/{other}"] == pytest.approx(1.0)
    sizes = {n: sum(t.numel() * t.element_size() for t in load_file(
        str(run_dir / "hf" / n / "adapter_model.safetensors")).values()) for n in ("odd", "even")}
    assert all(0 < r["perf/update_weights_bytes"] <= sizes["odd"] + sizes["even"] for r in records)


@pytest.mark.optin  # one more run (~50 s on 2 busy cores): -m optin
def test_session_server_agent_requests_name_the_adapter(tmp_path_factory: pytest.TempPathFactory,
                                                         tmp_path: Path) -> None:
    from milepost.testing.agent_model import make_agent_model

    model = make_agent_model(tmp_path_factory.getbasetemp() / "agent_model_shared")
    rows = [{"prompt": [{"role": "user", "content": f"Weather in {c}?"}], "label": w}
            for c, w in [("Oslo", "snow"), ("Rome", "hot"), ("Lima", "mild"), ("Bern", "snow")]]
    data = tmp_path / "weather.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    train(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", "2",
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "64",
           "--engine-max-total-tokens", "8192", "--run-dir", str(run_dir), "--device", "cpu",
           "--agent-function-path", "milepost.testing.agent_harness:weather_agent_fn",
           "--session-model-family", "qwen3", "--reward-fn", "milepost.rollout.layers:agent_reward",
           "--lora-rank", "4", "--lora-alpha", "8", "--check-weight-update-equal"])
    records = metrics(run_dir)
    assert len(records) == 2 and all(r["rollout/num_samples"] == 4 for r in records)
    # Multi-turn sessions: a base request would reuse its earlier turns' KV (0.68 without LoRA).
    assert all(r["rollout/prefix_cache_hit_rate"] == 0.0 for r in records), records
    assert all(0 < r["perf/update_weights_bytes"] < 100_000 for r in records)  # the adapter alone


def write_rollouts(directory: Path, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        groups = []
        for gi in range(2):
            group = []
            for i in range(2):
                prompt = torch.randint(3, 500, (5,), generator=g).tolist()
                response = torch.randint(3, 500, (4 + i,), generator=g).tolist()
                group.append(Sample(gi, i, tokens=prompt + response, response_length=len(response),
                                    reward=float(i)))
            groups.append(group)
        save_rollout(directory, step, groups)


@pytest.mark.optin  # two more runs (~45 s on 2 busy cores): -m optin
def test_ppo_critic_with_offload_turns_changes_nothing(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path / "m", "qwen3", seed=3)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    write_rollouts(tmp_path / "rollouts", 2)

    def run(name: str, *flags: str) -> Path:
        run_dir = tmp_path / name
        train(["--run-dir", str(run_dir), "--hf-checkpoint", str(tmp_path / "m"), "--prompt-data",
               str(tmp_path / "prompts.jsonl"), "--load-rollouts", str(tmp_path / "rollouts"),
               "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
               "--device", "cpu", "--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--lr", "1e-2",
               "--seed", "3", "--save-interval", "0", "--save-hf-at-end", "true", *LORA, *flags])
        return run_dir

    resident = run("resident", "--offload-actor-for-critic", "false")
    turns = run("turns", "--offload-actor-for-critic", "true", "--offload-train", "true",
                "--offload-train-destination", "disk")
    plain, moved = metrics(resident), metrics(turns)
    assert all(r["perf/actor_critic_swap_time"] > 0 for r in moved)
    for a, b in zip(plain, moved, strict=True):
        assert a["train/value_loss"] == b["train/value_loss"] and a["train/loss"] == b["train/loss"]
    a = load_file(str(resident / "hf" / "adapter_model.safetensors"))
    b = load_file(str(turns / "hf" / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert any(t.abs().sum() > 0 for n, t in a.items() if "lora_B" in n)  # the adapter trained


@pytest.mark.optin  # one more run (~50 s on 2 busy cores): -m optin
def test_colocated_tensor_handoff_carries_the_adapter(tmp_path: Path) -> None:
    model, prompts, env = parity_run_inputs(tmp_path, "qwen3")
    run_dir = tmp_path / "rl"
    train(["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--run-dir", str(run_dir),
           "--reward-fn", "lora_compose_rewards:parity", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8", "--lr", "1e-2",
           "--engine-max-total-tokens", "2048", "--num-rollout", "2", "--device", "cpu", *LORA,
           "--colocate", "--check-weight-update-equal", "--check-weight-update", "--save-hf-at-end", "true"],
          env)
    assert 'update_weight_transfer_mode = "tensor"' in (run_dir / "config.resolved.toml").read_text()
    records = metrics(run_dir)
    assert len(records) == 2
    adapter = load_file(str(run_dir / "hf" / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    base_bytes = (model / "model.safetensors").stat().st_size
    assert all(r["perf/update_weights_bytes"] == adapter_bytes < base_bytes / 10 for r in records)
    assert any(t.abs().sum() > 0 for n, t in adapter.items() if "lora_B" in n)  # the adapter trained
