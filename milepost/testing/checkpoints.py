"""Tiny random Hugging Face checkpoints (Llama, Qwen3, Qwen3-MoE) built with transformers' own classes.

Used by tests and CPU end-to-end runs: nothing is downloaded. Special token ids follow the tiny
tokenizer's convention: 0 = <|endoftext|> (pad), 1 = <|im_start|> (bos), 2 = <|im_end|> (eos).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Literal

import torch
import transformers

Arch = Literal["llama", "qwen3", "qwen3_moe"]

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    # Larger than the usual 0.02 so tiny models give peaked logits and clear router margins
    # (near-tied top-k experts would make routing comparisons flaky at fp32 rounding level).
    initializer_range=0.1,
    pad_token_id=PAD_ID,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

_DEFAULTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
}


def make_tiny_checkpoint(
    path: str | Path,
    arch: Arch,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Save a random tiny `arch` model (fp32, safetensors) and, if available, a tokenizer into `path`.

    `config_overrides` go straight to the transformers config class (e.g. num_hidden_layers=3,
    mlp_only_layers=[1], rope_parameters={...}). Returns `path`.
    """
    if arch not in _DEFAULTS:
        raise ValueError(f"arch must be one of {sorted(_DEFAULTS)}, got {arch!r}")
    config_name, model_name, defaults = _DEFAULTS[arch]
    kwargs = {**_COMMON, **defaults, **config_overrides, "vocab_size": vocab_size}
    config = getattr(transformers, config_name)(**kwargs)
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        _save_tokenizer(path, vocab_size)
    return path


def _save_tokenizer(path: Path, vocab_size: int) -> None:
    # The tokenizer module is written in parallel; absent module means "no tokenizer yet",
    # but a module that exists and fails must fail loudly.
    if importlib.util.find_spec("milepost.testing.tokenizer") is None:
        return
    from milepost.testing.tokenizer import save_tiny_tokenizer

    save_tiny_tokenizer(path, vocab_size)
