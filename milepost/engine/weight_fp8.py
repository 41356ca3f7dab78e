"""fp8 weight storage for the engine's linear layers (`--quantization fp8`).

Each projection (q/k/v/o, gate/up/down and their fused forms) keeps its weight as float8_e4m3fn with
one float32 scale per output row (scale = row amax / 448); activations stay in the model's dtype and
the forward dequantizes the weight, except for a compressed-tensors FP8-dynamic checkpoint served as
stored (`act_per_token`, lowprec/fp8_dynamic.py): its inputs are quantized per token too (W8A8,
kernels/fp8_rowwise.py) unless --fp8-weight-only. A scale per output row keeps the HF-name views
intact: a name that addresses a row slice of a fused weight (q_proj inside qkv_proj) owns exactly
its rows' scales. Embeddings, norms, lm_head and MoE experts stay unquantized, except the experts a
per-channel FP8 checkpoint stores in FP8: held as stored, per row too (lowprec/experts_fp8_row.py).

Weight updates quantize on arrival: every update path stages through WeightLoader, whose commit
calls `Fp8Weights.write` for an fp8 destination (the sender sends the model's dtype, as for any
engine). The equality check cannot be bit-exact for these tensors: the engine reports their
dequantized values and scales instead of digests (weight_check.py), and the trainer admits the
bound the format itself gives (milepost/weights/fp8.py: `fp8_error_bound`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from milepost.weights.fp8 import FP8, dequantize_rows, quantize_rows

if TYPE_CHECKING:
    from milepost.lowprec.experts_fp8_row import Fp8RowExperts
    from milepost.lowprec.quantize import QTensor

# Linear layers whose weights are stored in fp8 (their module names' last component).
QUANTIZED_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
                               "gate_proj", "up_proj", "down_proj", "gate_up_proj"})


class Fp8Linear(nn.Linear):
    """nn.Linear whose `weight` is fp8 with a per-row `weight_scale` buffer (set by store_fp8)."""

    weight_scale: torch.Tensor
    # An FP8-dynamic checkpoint's linears (served as stored, --fp8-weight-only unset): inputs
    # quantized per token too, W8A8 (kernels/fp8_rowwise.py); otherwise W8A16.
    act_per_token: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_per_token:
            from milepost.kernels.fp8_rowwise import rowwise_linear

            return rowwise_linear(x, self.weight, self.weight_scale, self.bias)
        # Dequantized in float32 then cast once: the scale keeps its 24-bit precision.
        w = dequantize_rows(self.weight, self.weight_scale).to(x.dtype)
        return F.linear(x, w, self.bias)


class Fp8Weights:
    """The model's fp8 linears, found from a weight view: where to write values and scales."""

    def __init__(self, modules: list[Fp8Linear], source_dtype: torch.dtype) -> None:
        self.source_dtype = source_dtype  # what senders send for these tensors (the model dtype)
        self._modules = modules
        self._by_storage: dict[int, Fp8Linear] = {}
        self.experts: Fp8RowExperts | None = None  # a per-channel FP8 checkpoint's MoE experts

    def owner(self, view: torch.Tensor) -> object | None:
        """The fp8 linear (or the row-scaled experts) `view` belongs to; None: not stored in fp8."""
        if view.dtype != FP8:
            return None
        hit = self.experts.owner(view) if self.experts is not None else None
        return hit if hit is not None else self._linear(view)

    def _linear(self, view: torch.Tensor) -> Fp8Linear | None:
        ptr = view.untyped_storage().data_ptr()
        module = self._by_storage.get(ptr)
        if module is None or module.weight.untyped_storage().data_ptr() != ptr:
            # Weights move (released to host and resumed: new storages): map them again.
            self._by_storage = {m.weight.untyped_storage().data_ptr(): m for m in self._modules}
            module = self._by_storage.get(ptr)
        return module

    def scale_of(self, view: torch.Tensor) -> torch.Tensor:
        """The scales of the rows `view` (a row slice of an fp8 weight) covers."""
        module = self._linear(view)
        if module is None:
            raise KeyError("not a view of an fp8 linear weight")
        row_bytes = module.weight.stride(0) * module.weight.element_size()
        first = (view.data_ptr() - module.weight.data_ptr()) // row_bytes
        return module.weight_scale[first:first + view.shape[0]]

    @torch.no_grad()
    def write(self, view: torch.Tensor, src: torch.Tensor) -> None:
        """Quantize `src` into the fp8 rows `view` and their scales."""
        if self.experts is not None and self.experts.owner(view) is not None:
            self.experts.write(view, src)  # each HF tensor per row, the same quantizer
            return
        values, scale = quantize_rows(src.to(view.device))
        view.copy_(values)
        self.scale_of(view).copy_(scale)

    def dequantized(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights, float32 row scales) that `view` holds."""
        if self.experts is not None and self.experts.owner(view) is not None:
            return self.experts.dequantized(view)
        scale = self.scale_of(view)
        return dequantize_rows(view, scale), scale.float()


@torch.no_grad()
def store_fp8(model: nn.Module, preset: dict[str, QTensor] | None = None) -> Fp8Weights:
    """Convert the model's projection linears to fp8 storage, in place; returns their registry,
    which is also attached to the model as `fp8_weights` (WeightLoader looks for it there).
    `preset`: a per-channel FP8 checkpoint's weights by HF name (fmt "fp8_row",
    lowprec/checkpoint_weights.py), stored as they are instead of quantizing the loaded weights.
    (A layerwise start does the same one layer at a time: lowprec/engine_load.py.)"""
    # What senders send for these tensors: the linears' dtype before conversion.
    dtype = next((m.weight.dtype for n, m in model.named_modules() if _projection(n, m)), None)
    modules = fp8_linears(model)
    if not modules:
        raise no_linears(model)
    store = Fp8Weights(modules, dtype)  # type: ignore[arg-type]
    if preset is not None:
        store_preset(model, store, preset)
        refuse_kept(model, store, preset.keys())
    model.fp8_weights = store
    return store


@torch.no_grad()
def fp8_linears(scope: nn.Module) -> list[Fp8Linear]:
    """The projection linears inside `scope` (the model, or one layer as it loads) converted to
    fp8 storage in place, each row quantized on its own (so the scope changes no bit)."""
    modules: list[Fp8Linear] = []
    for name, module in list(scope.named_modules()):
        if not _projection(name, module):
            continue
        values, scale = quantize_rows(module.weight)
        module.weight = nn.Parameter(values, requires_grad=False)
        module.register_buffer("weight_scale", scale)
        module.__class__ = Fp8Linear  # same state, a forward that dequantizes
        modules.append(module)  # type: ignore[arg-type]
    return modules


def _projection(name: str, module: nn.Module) -> bool:
    return type(module) is nn.Linear and name.rsplit(".", 1)[-1] in QUANTIZED_LINEARS


def no_linears(model: nn.Module) -> ValueError:
    return ValueError(f"--quantization fp8: {type(model).__name__} has no projection linears "
                      f"({', '.join(sorted(QUANTIZED_LINEARS))}) to store in fp8")


def store_preset(model: nn.Module, store: Fp8Weights, preset: dict[str, QTensor]) -> None:
    """The checkpoint's float8 rows and row scales into their views; a tensor this store does
    not hold (MoE experts) is refused: the store would not serve the checkpoint's values."""
    for name, q in preset.items():
        view = model.weight_view(name)
        if store.owner(view) is None:
            raise ValueError(f"{name}: a per-channel FP8 weight outside the projection linears "
                             "(q/k/v/o, gate/up/down) that the row-scaled fp8 store holds; serve "
                             "the checkpoint with --dequantize-checkpoint")
        view.copy_(q.values.to(view.device))
        store.scale_of(view).copy_(q.scales.reshape(-1))


def refuse_kept(model: nn.Module, store: Fp8Weights, quantized: Collection[str]) -> None:
    """Refuses a projection the checkpoint kept unquantized (not in `quantized`, its float8
    weights' names): the row store quantizes every projection."""
    kept = [n for n in model.hf_weight_names() if n not in quantized
            and store.owner(model.weight_view(n)) is not None]
    if kept:
        raise ValueError(f"{kept[0]}: stored unquantized by the checkpoint (its ignore list) but "
                         "a projection the row-scaled fp8 store quantizes; serve the checkpoint "
                         "with --dequantize-checkpoint")
