"""A Hugging Face directory of random weights for a native model's config, written one shard per
decoder layer, so that writing holds one layer at a time (real shapes of several GB fit a small
host). For engine-start measurements: the values are normal(0, 0.02), norms 1."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from milepost.models.meta import on_meta
from milepost.models.registry import model_class

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def write_random_checkpoint(dst: Path, config: object, dtype: torch.dtype = torch.bfloat16,
                            seed: int = 0) -> Path:
    """`config` (a transformers config with `architectures`) and random weights in `dtype` under
    `dst` (`model-00000.safetensors` the embeddings, norm and head, then one shard per layer)."""
    with on_meta():
        model = model_class(config)(config)
    groups: dict[int, list[str]] = {}
    for name in model.hf_weight_names():
        if model.tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _LAYER.match(name)
        groups.setdefault(int(m.group(1)) + 1 if m else 0, []).append(name)
    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for k in sorted(groups):
        tensors = {}
        for name in groups[k]:
            shape = tuple(model.weight_view(name).shape)  # a meta view: the shape alone
            t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
            tensors[name] = t.to(dtype)
        save_file(tensors, dst / f"model-{k:05d}.safetensors", metadata={"format": "pt"})
    config.save_pretrained(dst)
    return dst
