"""Engine start with `--quantization`: each decoder layer is loaded, fused and put in its store
before the next one gets any memory (`registry.load_native`'s per-layer hook), so the device
holds the served model plus one layer in `--dtype` at most, never the whole `--dtype` model.
- fp8_block | mxfp8 | nvfp4 | int4 (engine_store.StoreBuilder): each HF tensor is quantized on
  its own by the same function as `store_quantized` after a whole load, so the bits are the same.
- A quantized checkpoint served as stored (FP8 blockwise / per-tensor into fp8_block, INT4
  W4A16 / GPTQ into int4, per-channel FP8 into fp8): each layer's stored values and scales
  (QTensors) are taken as the layer loads and dropped once it is stored, as the whole-model
  path stores them (`store_engine_precision` / `store_fp8` with their preset).
- fp8 (per row, engine/weight_fp8.py): each row quantized on its own, so the same bits too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from milepost.engine.weight_fp8 import (
    Fp8Linear,
    Fp8Weights,
    fp8_linears,
    no_linears,
    refuse_kept,
    store_preset,
)
from milepost.lowprec.contract import BF16, Contract
from milepost.lowprec.engine_experts import Fp8Experts
from milepost.lowprec.engine_setup import (
    checkpoint_contract,
    engine_contract,
    read_input_scales,
    static_scales,
    warn_emulated,
)
from milepost.lowprec.engine_store import QuantizedLinear, StoreBuilder
from milepost.lowprec.experts_fp8_row import Fp8RowExperts, convert_row_experts, split_experts
from milepost.lowprec.fp8_dynamic import quantize_inputs_per_token, token_activations
from milepost.lowprec.experts_int4 import Int4Experts
from milepost.lowprec.quant_checkpoint import checkpoint_quant
from milepost.lowprec.quantize import QTensor
from milepost.models.base import CausalLM
from milepost.models.registry import load_model

log = logging.getLogger(__name__)


def load_quantized(args: object, dtype: torch.dtype, device: torch.device,
                   observe: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """The engine's model for resolved ServerArgs `args` (any `--quantization`), fused and
    stored layer by layer (`model.fp8_weights` is its store). `observe(model)`: called after each
    layer's tensors are in and before it is stored, the moment a layer's `--dtype` weights are
    held (tests and benchmarks measure the memory there). A model on the transformers fallback
    comes back unquantized (whole; the hook never runs): the caller refuses it."""
    fmt = args.quantization  # type: ignore[attr-defined]
    ckpt = checkpoint_quant(args.model_path)  # type: ignore[attr-defined]
    # The checkpoint's own values and scales by HF name, filled as each layer loads, when the
    # store holds them exactly (else the loaded weights are dequantized and quantized again).
    stored: dict[str, QTensor] | None = (
        {} if ckpt is not None and fmt == ckpt.serve_as and not ckpt.inexact else None)
    # An FP8-dynamic checkpoint served as stored: its linears quantize inputs per token (W8A8)
    # unless --fp8-weight-only keeps them in --dtype.
    tokens = token_activations(args, ckpt, stored is not None)
    store = _RowStore(dtype, stored, tokens) if fmt == "fp8" else _TensorStore(args, dtype, device, stored)
    peak = [0]  # bytes held when a layer is in, before it is stored (the start's high mark)

    def on_layer(model: CausalLM, prefix: str, layer: nn.Module) -> None:
        peak[0] = max(peak[0], held_bytes(model))
        if observe is not None:
            observe(model)
        i = int(prefix.rsplit(".", 1)[1])
        if i < model.num_layers:  # MTP layers stay unfused, as fuse_projections leaves them
            model.fuse_layer(i)
        names = [n for n in model.hf_weight_names() if n.startswith(prefix + ".")]
        store.add(model, prefix, layer, names)
        if stored is not None:  # stored: the layer's host copies go
            for n in names:
                stored.pop(n, None)

    model = load_model(args.model_path, dtype, device,  # type: ignore[attr-defined]
                       backend=args.model_impl, trust_remote_code=args.trust_remote_code,  # type: ignore[attr-defined]
                       fp8_weights=stored, on_layer=on_layer)
    if not getattr(model, "native", True):
        return model
    store.finish(model)
    log.info("--quantization %s: loaded and quantized layer by layer%s: %.1f MiB of weights, at "
             "most %.1f MiB held while loading", fmt, " (the checkpoint's values as stored)"
             if stored is not None else "", held_bytes(model) / 2**20, peak[0] / 2**20)
    return model


class _TensorStore:
    """fp8_block | mxfp8 | nvfp4 | int4, one layer at a time (engine_store.StoreBuilder); with
    `stored`, the checkpoint's QTensors as `store_engine_precision` takes them."""

    def __init__(self, args: object, dtype: torch.dtype, device: torch.device,
                 stored: dict[str, QTensor] | None) -> None:
        self.args = args
        fmt = args.quantization  # type: ignore[attr-defined]
        self.base = engine_contract(fmt, getattr(args, "precision_override", None),
                                    getattr(args, "nvfp4_four_over_six", False))
        warn_emulated(fmt, device)
        self.build = StoreBuilder(self.base, dtype,
                                  w8a8_experts=getattr(args, "fp8_w8a8_experts", False))
        self.stored = stored
        self.quantized: set[str] = set()  # every stored weight's name, for the final contract
        if stored is not None:
            self.build.preset = stored  # the same dict the loader fills (StoreBuilder keeps it)

    def add(self, model: CausalLM, prefix: str, layer: nn.Module, names: list[str]) -> None:
        stored = self.stored
        if stored is not None:
            self.quantized.update(n for n in names if n in stored)
            # checkpoint_contract's rule for this layer's names (exact-name bf16 overrides, so
            # each layer's part of the final contract is its own): covered tensors the
            # checkpoint kept unquantized stay in --dtype.
            kept = [n for n in names if n not in stored and self.base.tensor_format(n, "rollout") != BF16]
            if kept:
                c = self.build.contract
                overrides = c.overrides + tuple((n, BF16) for n in kept)
                self.build.contract = Contract(c.train, c.rollout, overrides, c.four_over_six)
        first = len(self.build.experts)
        self.build.add(model, layer, names, lambda name: f"{prefix}.{name}")
        if stored and len(self.build.experts) > first:  # their host copies go with the layer's
            registry = Int4Experts if self.base.rollout == "int4" else Fp8Experts
            self.build.put_preset_experts(model, registry(self.build.experts[first:]), names)

    def finish(self, model: CausalLM) -> None:
        if self.stored is not None:  # the whole contract, as store_engine_precision makes it
            self.quantized.update(self.stored)  # weights outside the layers (dequantized)
            self.stored.clear()
            self.build.contract = checkpoint_contract(self.base, model.hf_weight_names(), self.quantized)
        read_input_scales(self.build.finish(model, static_scales(self.args)), self.args)


class _RowStore:
    """`--quantization fp8` (one scale per row, engine/weight_fp8.py) one layer at a time; with
    `stored`, a per-channel FP8 checkpoint's rows and scales as `store_fp8` takes them."""

    def __init__(self, dtype: torch.dtype, stored: dict[str, QTensor] | None,
                 token_activations: bool = False) -> None:
        self.dtype = dtype
        self.token_activations = token_activations  # W8A8, kernels/fp8_rowwise.py (experts: W8A16)
        self.stored = stored
        self.quantized: set[str] = set()
        self.modules: list[Fp8Linear] = []
        self.experts: list = []  # the checkpoint's per-channel FP8 experts (experts_fp8_row.py)

    def add(self, model: CausalLM, prefix: str, layer: nn.Module, names: list[str]) -> None:
        modules = fp8_linears(layer)
        self.modules += modules
        if self.stored is not None:
            preset = {n: self.stored[n] for n in names if n in self.stored}
            self.quantized.update(preset)
            preset, experts = split_experts(preset)
            self.experts += convert_row_experts(model, layer, experts, lambda name: f"{prefix}.{name}")
            store_preset(model, Fp8Weights(modules, self.dtype), preset)

    def finish(self, model: CausalLM) -> None:
        self.modules += fp8_linears(model)  # any projection outside the layers, as store_fp8 does
        if not self.modules:
            raise no_linears(model)
        store = Fp8Weights(self.modules, self.dtype)
        store.experts = Fp8RowExperts(self.experts) if self.experts else None
        if self.stored is not None:
            store_preset(model, store, self.stored)  # weights outside the layers
            self.quantized.update(self.stored)
            self.stored.clear()
            refuse_kept(model, store, self.quantized)
        if self.token_activations:
            quantize_inputs_per_token(self.modules)
        model.fp8_weights = store


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
