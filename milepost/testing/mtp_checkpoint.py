"""Tiny DeepSeek-V3 checkpoints that carry a multi-token-prediction layer, as DeepSeek ships them.

transformers' DeepseekV3 does not build MTP layers, so the tiny checkpoint of hf_archs.py gets
them added: random `model.layers.{num_hidden_layers}.*` tensors (enorm, hnorm, eh_proj,
shared_head.norm, an MLA decoder layer, MoE experts), plus the copies of the embedding and LM head
DeepSeek's checkpoints keep there (`embed_tokens`, `shared_head.head`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from milepost.models.registry import load_native
from milepost.testing.hf_archs import make_tiny_hf_checkpoint


def make_tiny_mtp_checkpoint(path: str | Path, *, arch: str = "deepseek_v3", seed: int = 0,
                             vocab_size: int = 512, mtp_scale: float = 0.1, with_tokenizer: bool = False,
                             **config_overrides: Any) -> Path:
    """A tiny DeepSeek-V3 checkpoint (hf_archs.py) with one random MTP layer added (fp32)."""
    path = make_tiny_hf_checkpoint(path, arch, seed=seed, vocab_size=vocab_size,
                                   with_tokenizer=with_tokenizer, **config_overrides)
    model = load_native(path, torch.float32, "cpu")  # no MTP weights yet: built without them
    model.attach_mtp(1)
    n = model.num_layers
    g = torch.Generator().manual_seed(seed + 1000)
    extra: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.mtp.named_parameters():
            if name.endswith("norm.weight"):  # norms near 1, as trained ones are
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                value = mtp_scale * torch.randn(p.shape, generator=g)
            for hf_name, t in model.hf_tensors(f"mtp.{name}", value):
                extra[hf_name] = t.contiguous()
        extra[f"model.layers.{n}.embed_tokens.weight"] = model.model.embed_tokens.weight.clone()
        extra[f"model.layers.{n}.shared_head.head.weight"] = model.lm_head.weight.clone()
    shard = path / "model.safetensors"
    tensors = load_file(shard)
    save_file({**tensors, **extra}, shard, metadata={"format": "pt"})
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2))
    return path
