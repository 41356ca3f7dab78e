"""LoRA RL on a mixture-of-experts model: a real `milepost train` run on a tiny Qwen3-MoE (CPU) whose
adapter covers the experts (all-linear). The launcher starts the engines with one adapter slot, every
update carries the adapter alone (experts included), the engines merge the expert deltas, the
equality and per-update checks pass, and the run ends with a PEFT directory with peft's expert keys."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from tests.e2e.test_lora_composes import metrics, parity_run_inputs, train


def test_moe_expert_adapter_rl_run(tmp_path: Path) -> None:
    model, prompts, env = parity_run_inputs(tmp_path, "qwen3_moe")
    run_dir = tmp_path / "rl"
    train(["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--run-dir", str(run_dir),
           "--reward-fn", "lora_compose_rewards:parity", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8", "--lr", "1e-2",
           "--engine-max-total-tokens", "2048", "--num-rollout", "2", "--device", "cpu",
           "--lora-rank", "4", "--lora-alpha", "8", "--check-weight-update-equal", "--check-weight-update",
           "--save-hf-at-end", "true"],
          env)
    records = metrics(run_dir)
    assert len(records) == 2
    config = json.loads((run_dir / "hf" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    adapter = load_file(str(run_dir / "hf" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight" in adapter
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())  # fp32
    # measured 2026-12-04: 71,680 bytes each update (the fp32 adapter), the base file 766,728
    assert all(0 < r["perf/update_weights_bytes"] <= adapter_bytes for r in records)
    assert any(t.abs().max() > 0 for k, t in adapter.items() if ".mlp.experts." in k and ".lora_B." in k)
