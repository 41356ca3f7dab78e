"""The benchmarked model, twice: milepost's native model and transformers' with the same weights.

`--shape` builds a real architecture shape with random weights in memory (nothing is written to
disk: the Qwen3-30B-A3B shape is 61 GB in bf16); `--model` loads a Hugging Face directory. The
transformers copy is made after the engine's run, from the native weights, with the native
model moved to the host first so that one copy of the weights is on the device at a time.
"""

from __future__ import annotations

import gc
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from milepost.models.base import CausalLM
from milepost.models.registry import build_model, load_model

_QWEN3 = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, max_position_embeddings=4096)
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        _QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True)),
    "qwen3-4b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        _QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        _QWEN3, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False)),
    "tiny": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        _QWEN3, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True)),
}


def shape_config(shape: str) -> transformers.PretrainedConfig:
    config_cls, arch, kwargs = SHAPES[shape]
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [arch]
    return config


def native_model(model_dir: Path | None, shape: str | None, dtype: torch.dtype,
                 device: torch.device, seed: int) -> tuple[CausalLM, Path]:
    """The native model on `device`, and a directory holding its config.json (for ServerArgs)."""
    if model_dir is not None:
        return load_model(model_dir, dtype, device), model_dir
    config = shape_config(shape)
    config_dir = Path(tempfile.mkdtemp(prefix=f"milepost-bench-{shape}-"))
    config.save_pretrained(config_dir)
    model = build_model(config, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model, config_dir


def hf_copy(native: CausalLM, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """transformers' model of the same config with the native model's weights, on `device`.

    The native model is moved to the host first (its device memory is released).
    """
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older 5.x releases kept it here
        from transformers.modeling_utils import no_init_weights

    native.to("cpu")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    with torch.device(device), no_init_weights():
        hf = transformers.AutoModelForCausalLM.from_config(native.hf_config, dtype=dtype)
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            view = native.weight_view(name)
            if tuple(view.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: native {tuple(view.shape)} vs transformers {tuple(tensor.shape)}")
            tensor.copy_(view)
    return hf.eval()


def weight_bytes_per_decode_step(native: CausalLM, batch: int) -> float:
    """Bytes of weights one decode step of `batch` rows reads.

    Every weight matrix is read once, except the input embedding (a lookup reads `batch` rows;
    counted whole when tied to the LM head, which reads it all) and MoE experts, of which a step
    reads the expected number touched by batch * top_k uniform picks: E * (1 - (1 - k/E)^batch).
    """
    config = native.hf_config
    num_experts = getattr(config, "num_experts", 0) or 0
    top_k = native.moe_top_k
    seen: set[int] = set()
    total = 0.0
    for name, p in native.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        nbytes = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight") and not getattr(config, "tie_word_embeddings", False):
            nbytes = batch * p.shape[-1] * p.element_size()
        elif ".experts." in name and num_experts:
            touched = num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)
            nbytes *= min(touched, num_experts) / num_experts
        total += nbytes
    return total


def kv_bytes_per_token(native: CausalLM, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * native.num_layers * native.num_kv_heads * native.head_dim * elem


def parameter_count(native: CausalLM) -> int:
    return sum(p.numel() for p in {p.data_ptr(): p for p in native.parameters()}.values())


def human(n: float) -> str:
    if n <= 0:
        return "0"
    exp = min(int(math.log10(n) // 3), 4)
    return f"{n / 10 ** (3 * exp):.1f}{['', 'k', 'M', 'G', 'T'][exp]}"
