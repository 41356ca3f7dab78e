"""Random LoRA adapters for a tiny checkpoint, and the merged checkpoint (W + B A * alpha / r)
they must equal: the references of the engine's adapter tests (CPU and GPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from milepost.lora.settings import LoraSettings


def random_adapter(base: Path, settings: LoraSettings, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """Non-zero A [r, in] and B [out, r] for every targeted projection of the checkpoint at `base`."""
    g = torch.Generator().manual_seed(seed)
    weights = load_file(str(base / "model.safetensors"))
    out = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in settings.target_modules:
            out[f"{module}.lora_A.weight"] = torch.randn(settings.rank, w.shape[1], generator=g) * scale
            out[f"{module}.lora_B.weight"] = torch.randn(w.shape[0], settings.rank, generator=g) * scale
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
