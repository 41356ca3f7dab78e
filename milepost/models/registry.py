"""Native model construction: architecture name -> class, and loading a Hugging Face directory.

`load_model` reads config.json through transformers' AutoConfig and every *.safetensors shard,
copying each tensor through `weight_view` (so loading exercises the same name mapping that live
weight updates use). Missing or unexpected weights fail loudly instead of leaving random values.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from milepost.models.base import CausalLM
from milepost.models.llama import DecoderLM, LlamaForCausalLM
from milepost.models.qwen3 import Qwen3ForCausalLM
from milepost.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# Checkpoint entries that are derived state, not weights (old Llama exports saved RoPE tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def model_class(hf_config: object) -> type[DecoderLM]:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {archs[0] if archs else None!r} has no native definition; supported: "
            f"{sorted(MODEL_REGISTRY)} (use the transformers backend for others)"
        )
    return MODEL_REGISTRY[archs[0]]


def build_model(hf_config: object, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """An uninitialized model (parameters hold garbage) in `dtype` on `device`; fill it via weight_view."""
    cls = model_class(hf_config)
    # Build on meta so no time is spent on random init, then allocate storage once in place.
    with torch.device("meta"):
        model = cls(hf_config)
    model = model.to(dtype=dtype).to_empty(device=device)
    if model.tie_word_embeddings:  # to_empty keeps ties only if they are re-established
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """Build the model for the Hugging Face directory `path` and load all its safetensors shards."""
    path = Path(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(
            f"no *.safetensors files in {path} (only safetensors checkpoints load natively)"
        )
    model = build_model(AutoConfig.from_pretrained(path), dtype, device)
    expected = set(model.hf_weight_names())
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for shard in shards:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    try:
                        view = model.weight_view(name)
                    except KeyError:
                        unexpected.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(view.shape):
                        raise ValueError(
                            f"{shard.name}: {name} has shape {tuple(tensor.shape)}, the model expects "
                            f"{tuple(view.shape)}; does config.json match the weights?"
                        )
                    view.copy_(tensor)
                    loaded.add(name)
    if unexpected:
        raise ValueError(f"{path}: weights unknown to {type(model).__name__}: {_short(unexpected)}")
    # A fused expert name fills every per-expert slice of its layer at once.
    for name in [n for n in loaded if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        prefix, fused = name.rsplit(".", 1)
        suffixes = ("gate_proj.weight", "up_proj.weight")
        if fused == "down_proj":
            suffixes = ("down_proj.weight",)
        loaded.update(n for n in expected if n.startswith(prefix + ".") and n.endswith(suffixes))
    if model.tie_word_embeddings:
        loaded.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(
            f"{path}: checkpoint lacks {len(missing)} weights of {type(model).__name__}: {_short(missing)}"
        )
    return model


def _short(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
