"""Random LoRA adapters for a tiny checkpoint, and the merged checkpoint (W + B A * alpha / r)
they must equal: the references of the engine's adapter tests (CPU and GPU)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from milepost.lora.experts import expert_delta, expert_targets
from milepost.lora.settings import LoraSettings


def random_adapter(base: Path, settings: LoraSettings, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Non-zero A [r, in] and B [out, r] for every targeted projection of the checkpoint at `base`;
    on mixture-of-experts layers A [E, r, in] and B [E, out, r] per stacked expert parameter."""
    g = torch.Generator().manual_seed(seed)
    weights = load_file(str(base / "model.safetensors"))
    out = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if ".mlp.experts." in name:
            continue
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in settings.target_modules:
            out[f"{module}.lora_A.weight"] = torch.randn(settings.rank, w.shape[1], generator=g) * scale
            out[f"{module}.lora_B.weight"] = torch.randn(w.shape[0], settings.rank, generator=g) * scale
    for key, w in _stacked_experts(weights).items():
        if key.rsplit(".", 1)[1] in expert_targets(settings.target_modules):
            e, fan_out, fan_in = w.shape
            out[f"{key}.lora_A.weight"] = torch.randn(e, settings.rank, fan_in, generator=g) * scale
            out[f"{key}.lora_B.weight"] = torch.randn(e, fan_out, settings.rank, generator=g) * scale
    return out


_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


def _stacked_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{'model.layers.N.mlp.experts.gate_up_proj': [E, 2I, H], '...down_proj': [E, H, I]} from the
    hub's per-expert names (gate rows then up rows, as the native model stacks them)."""
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, w in weights.items():
        m = _PER_EXPERT.fullmatch(name)
        if m:
            parts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = w
    out = {}
    for prefix, experts in parts.items():
        order = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([experts[e]["down"] for e in order])
    return out


def merged_checkpoint(base: Path, out: Path, settings: LoraSettings, adapter: dict[str, torch.Tensor]) -> Path:
    """A copy of `base` with the adapter merged into its weights (in fp32, then the file's dtype)."""
    shutil.copytree(base, out)
    weights = load_file(str(base / "model.safetensors"))
    for name in list(weights):
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in adapter:
            a, b = adapter[f"{module}.lora_A.weight"], adapter[f"{module}.lora_B.weight"]
            w = weights[name]
            weights[name] = (w.float() + (b @ a) * settings.scaling).to(w.dtype)
    for key, w in _stacked_experts(weights).items():  # the engine's merge: base + expert_delta
        if f"{key}.lora_A.weight" not in adapter:
            continue
        merged = (w.float() + expert_delta(adapter[f"{key}.lora_A.weight"], adapter[f"{key}.lora_B.weight"],
                                           settings.scaling)).to(w.dtype)
        inter = merged.shape[1] // 2
        for e in range(merged.shape[0]):
            if key.endswith("down_proj"):
                weights[f"{key.removesuffix('down_proj')}{e}.down_proj.weight"] = merged[e].contiguous()
            else:
                weights[f"{key.removesuffix('gate_up_proj')}{e}.gate_proj.weight"] = merged[e, :inter].contiguous()
                weights[f"{key.removesuffix('gate_up_proj')}{e}.up_proj.weight"] = merged[e, inter:].contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dequantized_checkpoint(base: Path, out: Path, dtype: torch.dtype | None = None) -> Path:
    """A copy of `base` whose projection weights are what an `--quantization fp8` engine holds
    (fp8 rows dequantized): the base that engine's adapters must be compared against.

    dtype: the engine's dtype. The engine casts the checkpoint to it before quantizing, so a row's
    scale comes from the cast values; quantizing the file's fp32 values instead picks other
    scales (61 of 64 rows of a tiny Qwen3's q_proj differed in bf16)."""
    from milepost.engine.weight_fp8 import QUANTIZED_LINEARS
    from milepost.weights.fp8 import dequantize_rows, quantize_rows

    shutil.copytree(base, out)
    weights = load_file(str(base / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in QUANTIZED_LINEARS:
            weights[name] = dequantize_rows(*quantize_rows(w.to(dtype or w.dtype))).to(dtype or w.dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
