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
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from transformers import AutoConfig

from milepost.lowprec.checkpoint_weights import (
    dequantize_weight,
    is_companion,
    is_quantized,
    on_device,
    read_weight,
    weight_name,
)
from milepost.lowprec.quant_checkpoint import CheckpointQuant, checkpoint_quant
from milepost.lowprec.quantize import QTensor
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
_LAYER_OF = re.compile(r"model\.layers\.(\d+)\.")
# load_native's per-layer hook: (model, the layer's HF prefix "model.layers.N", the layer)
UnitHook = Callable[[CausalLM, str, torch.nn.Module], None]


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
    fp8_weights: dict[str, QTensor] | None = None, on_layer: UnitHook | None = None,
) -> CausalLM:
    """The model for the Hugging Face directory `path`: native when possible, else the fallback.

    backend "native" refuses with the reason instead of falling back; "transformers" always
    loads the fallback (e.g. to compare against it). An FP8 blockwise checkpoint loads natively
    only, dequantized into `dtype` (`load_native`); `fp8_weights` receives its QTensors.
    `on_layer`: `load_native`'s per-layer hook (the fallback loads whole and never calls it).
    """
    config = checkpoint_config(path, trust_remote_code)
    reason = "custom modeling code (auto_map)" if getattr(config, "auto_map", None) else native_reason(config)
    if (backend == "transformers" or reason is not None) and checkpoint_quant(path) is not None:
        raise ValueError(f"{path}: a quantized checkpoint loads on a native model only "
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
    return load_native(path, dtype, device, fp8_weights=fp8_weights, on_layer=on_layer)


def _arch(config: object) -> str:
    archs = getattr(config, "architectures", None) or [type(config).__name__]
    return str(archs[0])


def build_model(hf_config: object, dtype: torch.dtype, device: torch.device | str,
                mtp_layers: int = 0, layers_on_meta: bool = False) -> CausalLM:
    """An uninitialized model (parameters hold garbage) in `dtype` on `device`; fill it via weight_view.

    mtp_layers: multi-token-prediction layers to build too (models/mtp.py; DeepSeek-V3 only).
    layers_on_meta: the decoder (and MTP) layers stay on the meta device, holding no memory,
    until `materialize` gives each its storage (`load_native`'s layer-by-layer load)."""
    cls = model_class(hf_config)
    # Build on meta so no time is spent on random init, then allocate storage once in place.
    with on_meta():
        model = cls(hf_config)
        if mtp_layers:
            model.attach_mtp(mtp_layers)
    model = model.to(dtype=dtype)
    if layers_on_meta:
        inside = {id(m) for _, unit in layer_units(model) for m in unit.modules()}
        for m in model.modules():
            if id(m) not in inside:
                materialize(m, device, recurse=False)
    else:
        materialize(model, device)
    if model.tie_word_embeddings:  # new storage keeps ties only if they are re-established
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def materialize(module: torch.nn.Module, device: torch.device | str, recurse: bool = True) -> None:
    """Give `module`'s meta parameters and buffers uninitialized storage on `device`."""
    # torch.empty, not `to_empty`: its empty_like of a meta tensor runs torch's Python
    # reference kernel, whose first use imports sympy (~0.6 s of CPU per process).
    module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), recurse=recurse)


def layer_units(model: CausalLM) -> list[tuple[str, torch.nn.Module]]:
    """(HF prefix, module) of each decoder layer and then each MTP layer, in checkpoint order:
    `model.layers.{i}` for both (an MTP layer i is checkpoint layer num_layers + i)."""
    layers = [*model.model.layers, *getattr(model, "mtp", ())]
    return [(f"model.layers.{i}", layer) for i, layer in enumerate(layers)]


def load_native(path: str | Path, dtype: torch.dtype, device: torch.device | str, *,
                fp8_weights: dict[str, QTensor] | None = None, on_layer: UnitHook | None = None) -> CausalLM:
    """Build the native model for the Hugging Face directory `path` and load all its safetensors shards.

    Tensors load layer by layer (the embeddings, final norm and head first, then each decoder
    layer, then any MTP layer). `on_layer(model, hf_prefix, layer)`: the layers then stay on the
    meta device until their turn, and each is handed to `on_layer` once its tensors are in (an
    engine quantizes it there), so no more than one layer is held as loaded at a time.

    A quantized checkpoint (FP8 or INT4, lowprec/quant_checkpoint.py): each quantized weight is
    dequantized into its view (values times scales in float32, checkpoint_weights.dequantize_weight,
    then `dtype`); `fp8_weights`, when given, receives each one's QTensor (the checkpoint's
    values, for an engine that stores them as they are)."""
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
    model = build_model(config, dtype, device, mtp_layers=mtp, layers_on_meta=on_layer is not None)
    units = layer_units(model)
    expected = set(model.hf_weight_names())
    loaded: set[str] = set()
    unexpected: list[str] = []
    ckpt = checkpoint_quant(path)  # refuses a quantized layout it cannot read
    with torch.no_grad(), ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(s), framework="pt", device="cpu")) for s in shards]
        # A weight's scales may sit in another shard: index them first (names only).
        scale_of = {n: h for h in handles for n in h.keys() if is_companion(ckpt, n)}
        by_unit: dict[int, list[tuple[str, Path, object]]] = {}
        last_use = [-1] * len(handles)  # the last layer that reads each shard (its scales too)
        for k, (shard, f) in enumerate(zip(shards, handles)):
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (mtp and is_mtp_copy(name, config.num_hidden_layers)):
                    continue
                m = _LAYER_OF.match(name)
                unit = int(m.group(1)) if m and int(m.group(1)) < len(units) else -1
                last_use[k] = max(last_use[k], unit)
                if name not in scale_of:  # a scale is read with its weight
                    by_unit.setdefault(unit, []).append((name, shard, f))
        for i in range(-1, len(units)):  # -1: outside the layers (a name of no layer: unexpected)
            if on_layer is not None and i >= 0:
                materialize(units[i][1], device)
            for name, shard, f in by_unit.get(i, ()):
                loaded.update(_load_tensor(model, name, shard, f, scale_of, ckpt, fp8_weights, unexpected))
            for k in (k for k, last in enumerate(last_use) if last == i):
                # Unmapped once read (before the hook quantizes the layer): the pages read so
                # far leave the process's resident set.
                handles[k].__exit__(None, None, None)
            if on_layer is not None and i >= 0:
                on_layer(model, *units[i])
    orphans = sorted(n for n in scale_of if n not in loaded)
    if orphans:
        raise ValueError(f"{path}: scales without a quantized weight: {_short(orphans)}")
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


def _load_tensor(model: CausalLM, name: str, shard: Path, f: object, scale_of: dict[str, object],
                 ckpt: CheckpointQuant | None, fp8_weights: dict[str, QTensor] | None,
                 unexpected: list[str]) -> list[str]:
    """Copy checkpoint tensor `name` into its view (a quantized one dequantized with its scales,
    lowprec/checkpoint_weights.py); the HF names and scales read (none when the model has no
    such weight: listed in `unexpected`)."""
    hf = weight_name(ckpt, name)  # X.weight_packed holds X.weight
    try:
        view = model.weight_view(hf)
    except KeyError:
        unexpected.append(name)
        return []
    read = [hf]

    def companion(n: str) -> torch.Tensor | None:
        if n not in scale_of:
            return None
        read.append(n)
        return scale_of[n].get_tensor(n)

    tensor = f.get_tensor(name)
    q = read_weight(ckpt, hf, tensor, companion) if is_quantized(ckpt, name, tensor.dtype) else None
    shape = q.shape if q is not None else tensor.shape
    if tuple(shape) != tuple(view.shape):
        raise ValueError(
            f"{shard.name}: {name} has shape {tuple(shape)}, the model expects "
            f"{tuple(view.shape)}; does config.json match the weights?"
        )
    if q is not None:
        if fp8_weights is not None:
            fp8_weights[hf] = q
        # On the weights' device (a GPU multiplies in no time; float32 products are
        # correctly rounded everywhere, so the bits are the CPU's).
        tensor = dequantize_weight(on_device(q, view.device))
    elif tensor.dtype.itemsize == 1 and tensor.is_floating_point():
        raise ValueError(f"{shard.name}: {name} is {tensor.dtype} but config.json has no FP8 "
                         "quantization_config (quant_method fp8 or compressed-tensors)")
    view.copy_(tensor)
    return read
