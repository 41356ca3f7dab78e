"""Engine start with `--quantization fp8_block|mxfp8|nvfp4|int4` from an unquantized checkpoint:
each decoder layer is loaded, fused and quantized before the next one gets any memory
(`registry.load_native`'s per-layer hook), so the device holds the quantized model plus one
layer in `--dtype` at most, never the whole `--dtype` model. Each HF tensor is quantized on its
own by the same function as `store_quantized` after a whole load, so the bits are the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from milepost.lowprec.engine_setup import (
    engine_contract,
    read_input_scales,
    static_scales,
    warn_emulated,
)
from milepost.lowprec.engine_store import QuantizedLinear, StoreBuilder
from milepost.models.base import CausalLM
from milepost.models.registry import load_model

log = logging.getLogger(__name__)


def load_quantized(args: object, dtype: torch.dtype, device: torch.device,
                   observe: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """The engine's model for resolved ServerArgs `args`, fused and quantized layer by layer
    (`model.fp8_weights` is its store). `observe(model)`: called after each layer's tensors are
    in and before it is quantized, the moment a layer's `--dtype` weights are held (tests and
    benchmarks measure the memory there). A model on the transformers fallback comes back
    unquantized (whole; the hook never runs): the caller refuses it."""
    fmt = args.quantization  # type: ignore[attr-defined]
    contract = engine_contract(fmt, getattr(args, "precision_override", None),
                               getattr(args, "nvfp4_four_over_six", False))
    warn_emulated(fmt, device)
    build = StoreBuilder(contract, dtype)
    peak = [0]  # bytes held when a layer is in, before it is quantized (the start's high mark)

    def on_layer(model: CausalLM, prefix: str, layer: nn.Module) -> None:
        peak[0] = max(peak[0], held_bytes(model))
        if observe is not None:
            observe(model)
        i = int(prefix.rsplit(".", 1)[1])
        if i < model.num_layers:  # MTP layers stay unfused, as fuse_projections leaves them
            model.fuse_layer(i)
        names = [n for n in model.hf_weight_names() if n.startswith(prefix + ".")]
        build.add(model, layer, names, lambda name: f"{prefix}.{name}")

    model = load_model(args.model_path, dtype, device,  # type: ignore[attr-defined]
                       backend=args.model_impl, trust_remote_code=args.trust_remote_code,  # type: ignore[attr-defined]
                       on_layer=on_layer)
    if not getattr(model, "native", True):
        return model
    read_input_scales(build.finish(model, static_scales(args)), args)
    log.info("--quantization %s: loaded and quantized layer by layer: %.1f MiB of weights, at "
             "most %.1f MiB held while loading", fmt, held_bytes(model) / 2**20, peak[0] / 2**20)
    return model


def held_bytes(model: nn.Module) -> int:
    """Bytes of every storage the model's weights hold (off the meta device): parameters, buffers
    and the quantized values an emulated linear keeps beside its dequantized weight; a storage
    shared by several tensors counts once."""
    tensors = [*model.parameters(), *model.buffers()]
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            tensors += [t for _, _, q in m.qparts for t in (q.values, q.scales)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if not t.is_meta}
    return sum(storages.values())
