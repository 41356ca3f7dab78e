"""Tiny random checkpoints of architectures beyond checkpoints.py's three, for the fallback's tests.

Each entry is built offline with transformers' own config and model classes, small enough for CPU
tests, and set up so the feature that makes the family different is exercised: sliding windows
shorter than the test sequences, soft-capping, attention sinks, partial rotary, logit scaling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from milepost.testing.checkpoints import BOS_ID, EOS_ID, PAD_ID

_COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
    pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
)

# name -> (config class, model class, overrides): what each exercises is in the comment.
TINY_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # qkv bias; layers 1-2 slide over 4 tokens (max_window_layers=1)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen2_full": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),  # native path
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),  # every layer slides
    # alternating sliding/global layers, attention and final logit soft-capping (caps that bite), sandwich norms
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=4, query_pre_attn_scalar=16,
                                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # sliding/global layers with their own RoPE bases, q/k norms, scaled embeddings
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # fused qkv_proj / gate_up_proj
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5)),  # partial rotary, parallel residual
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # post-norms, q/k norms over all heads
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.5)),  # scaled logits
    # MoE with attention sinks, alternating sliding/full layers
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2)),
    # MLA (q LoRA, interleaved RoPE), one dense layer then MoE: 8 experts in 4 groups, 2 groups kept
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5)),
    # MLA without q LoRA, rotate-half RoPE, unnormalized top-k weights
    "deepseek_v3_plain": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
        v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=0, rope_interleave=False,
        norm_topk_prob=False)),
}


def make_tiny_hf_checkpoint(
    path: str | Path, arch: str, *, seed: int = 0, vocab_size: int = 512, with_tokenizer: bool = False,
    **config_overrides: Any,
) -> Path:
    """Save a random tiny model of `arch` (a TINY_ARCHS key) in fp32 safetensors to `path`."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {sorted(TINY_ARCHS)}, got {arch!r}")
    config_name, model_name, overrides = TINY_ARCHS[arch]
    kwargs = {**_COMMON, **overrides, **config_overrides, "vocab_size": vocab_size}
    config = getattr(transformers, config_name)(**kwargs)
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    with torch.no_grad():  # transformers initializes DeepSeek's routing bias to zeros: make it matter
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.5)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        from milepost.testing.tokenizer import save_tiny_tokenizer

        save_tiny_tokenizer(path, vocab_size)
    return path
