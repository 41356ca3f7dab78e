"""Model construction: architecture name -> native class, else the transformers fallback.

The one switch: `load_model` builds the native definition when the architecture has one and its
config uses only what that definition implements; otherwise (naming the reason in a warning) it
loads transformers' own model behind the same contract (hf_fallback.py: exact, slower). Native
loading reads every *.safetensors shard through `weight_view` (the name mapping live weight
updates use); missing or unexpected weights fail loudly instead of leaving random values.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from transformers import AutoConfig

from milepost.lowprec.fp8_checkpoint import SCALE_INV_SUFFIX, checkpoint_qtensor, fp8_checkpoint
from milepost.lowprec.quantize import QTensor, dequantize
from milepost.models.base import CausalLM
from milepost.models.deepseek_v3 import DeepseekV3ForCausalLM
from milepost.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from milepost.models.gpt_oss import GptOssForCausalLM
from milepost.models.llama import DecoderLM, LlamaForCausalLM
from milepost.models.meta import on_meta
from milepost.models.mistral import MistralForCausalLM
from milepost.models.mtp import is_mtp_copy, mtp_layers_in_checkpoint
from milepost.models.qwen2 import Qwen2ForCausalLM
from milepost.models.qwen3 import Qwen3ForCausalLM
from milepost.models.qwen3_moe import Qwen3MoeForCausalLM

log = logging.getLogger(__name__)
Backend = Literal["auto", "native", "transformers"]

MODEL_REGISTRY: dict[str, type[DecoderLM]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

# Checkpoint entries that are derived state, not weights (old Llama exports saved RoPE tables).
# Static FP8 activation scales (`<module>.input_scale`) are not weights of the model: an engine
# with `--fp8-activation-scheme static` reads them after quantizing (lowprec/engine_scales.py).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".input_scale")


def model_class(hf_config: object) -> type[DecoderLM]:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs or archs[0] not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {archs[0] if archs else None!r} has no native definition; supported: "
            f"{sorted(MODEL_REGISTRY)} (others load through the transformers fallback)"
        )
    return MODEL_REGISTRY[archs[0]]


def native_reason(hf_config: object) -> str | None:
    """Why `hf_config` cannot run on a native definition (naming the field), or None if it can."""
    try:
        cls = model_class(hf_config)
        with on_meta():  # construction runs every config check, allocating nothing
            cls(hf_config)
    except (ValueError, KeyError, AttributeError) as e:
        return str(e)
    return None


def checkpoint_config(path: str | Path, trust_remote_code: bool = False) -> object:
    """config.json through AutoConfig; custom code (auto_map) is refused unless trusted."""
    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("auto_map") and not trust_remote_code:
        raise ValueError(
            f"{path}/config.json has auto_map: the model needs its own modeling code, which runs only "
            "with --trust-remote-code (milepost serve); review that code before trusting it"
        )
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device | str, *,
    backend: Backend = "auto", trust_remote_code: bool = False,
    fp8_weights: dict[str, QTensor] | None = None,
) -> CausalLM:
    """The model for the Hugging Face directory `path`: native when possible, else the fallback.

    backend "native" refuses with the reason instead of falling back; "transformers" always
    loads the fallback (e.g. to compare against it). An FP8 blockwise checkpoint loads natively
    only, dequantized into `dtype` (`load_native`); `fp8_weights` receives its QTensors.
    """
    config = checkpoint_config(path, trust_remote_code)
    reason = "custom modeling code (auto_map)" if getattr(config, "auto_map", None) else native_reason(config)
    if (backend == "transformers" or reason is not None) and fp8_checkpoint(path) is not None:
        raise ValueError(f"{path}: an FP8 blockwise checkpoint loads on a native model only "
                         f"({reason or '--model-impl transformers was given'}); use the model's "
                         "bf16 checkpoint")
    if backend == "transformers" or (backend == "auto" and reason is not None):
        from milepost.models.hf_fallback import load_fallback

        if backend == "auto":
            log.warning(
                "%s runs on the transformers fallback (exact log-probs, but slower: no fused projections, "
                "fused kernels or CUDA graphs): %s", _arch(config), reason)
        return load_fallback(path, dtype, device, trust_remote_code=trust_remote_code)
    if reason is not None:
        raise ValueError(f"{path}: no native path: {reason}")
    return load_native(path, dtype, device, fp8_weights=fp8_weights)


def _arch(config: object) -> str:
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    return str(archs[0])


def build_model(hf_config: object, dtype: torch.dtype, device: torch.device | str,
                mtp_layers: int = 0) -> CausalLM:
    """An uninitialized model (parameters hold garbage) in `dtype` on `device`; fill it via weight_view.

    mtp_layers: multi-token-prediction layers to build too (models/mtp.py; DeepSeek-V3 only)."""
    cls = model_class(hf_config)
    # Build on meta so no time is spent on random init, then allocate storage once in place.
    with on_meta():
        model = cls(hf_config)
        if mtp_layers:
            model.attach_mtp(mtp_layers)
    # Storage allocated with torch.empty, not `to_empty`: its empty_like of a meta tensor runs
    # torch's Python reference kernel, whose first use imports sympy (~0.6 s of CPU per process).
    model = model.to(dtype=dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if model.tie_word_embeddings:  # new storage keeps ties only if they are re-established
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_native(path: str | Path, dtype: torch.dtype, device: torch.device | str, *,
                fp8_weights: dict[str, QTensor] | None = None) -> CausalLM:
    """Build the native model for the Hugging Face directory `path` and load all its safetensors shards.

    An FP8 blockwise checkpoint (lowprec/fp8_checkpoint.py): each float8 weight is dequantized
    into its view (`weight * weight_scale_inv` per tile in float32, `quantize.dequantize`, then
    `dtype`); `fp8_weights`, when given, receives each one's QTensor (the checkpoint's bytes, for
    an engine that stores them as they are)."""
    path = Path(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(
            f"no *.safetensors files in {path} (only safetensors checkpoints load natively)"
        )
    config = AutoConfig.from_pretrained(path)
    # MTP layers are built when the weights hold them (the config's count alone is no evidence:
    # transformers' DeepseekV3Config defaults it to 1); the trainer then keeps and exports them too.
    mtp = mtp_layers_in_checkpoint(path, config) if getattr(model_class(config), "supports_mtp", False) else 0
    model = build_model(config, dtype, device, mtp_layers=mtp)
    expected = set(model.hf_weight_names())
    loaded: set[str] = set()
    unexpected: list[str] = []
    fp8 = fp8_checkpoint(path) is not None  # refuses a quantized layout it cannot hold
    with torch.no_grad(), ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(s), framework="pt", device="cpu")) for s in shards]
        # A weight's scale may sit in another shard: index them first (names only).
        scale_of = {n: h for h in handles for n in h.keys() if fp8 and n.endswith(SCALE_INV_SUFFIX)}
        for shard, f in zip(shards, handles):
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (mtp and is_mtp_copy(name, config.num_hidden_layers)):
                    continue
                if name in scale_of:
                    continue  # read with its weight
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
                if tensor.dtype == torch.float8_e4m3fn and fp8:
                    scale = name.removesuffix(".weight") + SCALE_INV_SUFFIX
                    q = checkpoint_qtensor(name, tensor, scale_of[scale].get_tensor(scale)
                                           if scale in scale_of else None)
                    if fp8_weights is not None:
                        fp8_weights[name] = q
                    # On the weights' device (a GPU multiplies in no time; float32 products are
                    # correctly rounded everywhere, so the bits are the CPU's).
                    tensor = dequantize(QTensor(q.fmt, q.values.to(view.device), q.scales.to(view.device),
                                                q.tile, q.shape))
                    loaded.add(scale)
                elif tensor.dtype.itemsize == 1 and tensor.is_floating_point():
                    raise ValueError(f"{shard.name}: {name} is {tensor.dtype} but config.json has no "
                                     "FP8 blockwise quantization_config (fp8, e4m3, [128, 128])")
                view.copy_(tensor)
                loaded.add(name)
    orphans = sorted(n for n in scale_of if n not in loaded)
    if orphans:
        raise ValueError(f"{path}: scales without a float8 weight: {_short(orphans)}")
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
