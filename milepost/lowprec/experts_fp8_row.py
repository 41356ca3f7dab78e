"""Per-channel FP8 MoE experts: the experts of a compressed-tensors "FP8-dynamic" checkpoint
(`strategy: channel`: float8_e4m3 values, one scale per output row of each Hugging Face tensor
`experts.N.gate_proj` / `up_proj` / `down_proj`), held as stored by the row-scaled fp8 store
(`--quantization fp8`, engine/weight_fp8.py, which holds the projection linears the same way).

A row scale is a block scale whose tile is one row by the whole contraction dim, so these are the
blockwise FP8 experts (lowprec/engine_experts.py) with scales w13 [E, 2, I, 1] (gate's rows, then
up's) and w2 [E, H, 1]: the same class, registry, update path and fused FP8 MoE kernels (which
address a row scale as a [N, 1] block scale), only the scales' tile and the quantizer differ.
Updates re-quantize each HF tensor per row on arrival with the row store's own quantizer
(`weights.fp8.quantize_rows`), so `--check-weight-update-equal` admits its bound (`fp8_error_bound`).
Only experts the checkpoint stores in FP8 are converted (`--quantization fp8` on an unquantized
checkpoint keeps experts in --dtype, as before); a layer whose experts are partly FP8 is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from milepost.lowprec.engine_experts import Fp8Experts, Fp8StackedExperts, convert_fp8_experts
from milepost.lowprec.quantize import QTensor
from milepost.models.qwen3_moe import StackedExperts
from milepost.weights.fp8 import dequantize_rows, quantize_rows

ROW_FORMAT = "fp8_row"  # the QTensor format of a row-scaled tensor (lowprec/checkpoint_weights.py)


class Fp8RowStackedExperts(Fp8StackedExperts):
    """Fp8StackedExperts with one float32 scale per row: w13_scale [E, 2, I, 1], w2_scale
    [E, H, 1] (class swapped in by `convert_row_experts`)."""

    row_scales = True

    def dequantize_w13(self) -> torch.Tensor:
        """float32 [E, 2I, H]: each row's values times its scale (weights.fp8.dequantize_rows)."""
        e, two_i, _ = self.w13.shape
        return self.w13.float() * self.w13_scale.reshape(e, two_i, 1)

    def dequantize_w2(self) -> torch.Tensor:
        """float32 [E, H, I]."""
        return self.w2.float() * self.w2_scale

    def qtensor(self, e: int, which: int) -> QTensor:
        """One HF tensor as stored: values [rows, cols] and scales [rows, 1] (views)."""
        inter = self.intermediate
        if which == 2:
            values, scales = self.w2[e], self.w2_scale[e]
        else:
            values, scales = self.w13[e, which * inter:(which + 1) * inter], self.w13_scale[e, which]
        return QTensor(ROW_FORMAT, values, scales, (1, values.shape[1]), tuple(values.shape))


class Fp8RowExperts(Fp8Experts):
    """The registry of the row-scaled experts: `write` re-quantizes per row, `dequantized` gives
    the values and the row scales (shaped like the values less their last dim), which is what the
    row store's equality check takes (weights/verify.py, `fp8_error_bound`)."""

    fmt = ROW_FORMAT

    def quantize_part(self, src: torch.Tensor, name: str) -> QTensor:
        values, scale = quantize_rows(src)
        return QTensor(ROW_FORMAT, values, scale.reshape(-1, 1), (1, src.shape[1]), tuple(src.shape))

    def dequantized(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        module, parts = self.parts(view)
        qs = [module.qtensor(e, w) for e, w in parts]
        values = torch.cat([dequantize_rows(q.values, q.scales.reshape(-1)) for q in qs])
        scales = torch.cat([q.scales.reshape(-1).float() for q in qs])
        shape = self.hf_shape(view)
        return values.reshape(shape), scales.reshape(shape[:-1])


def split_experts(preset: Mapping[str, QTensor] | None
                  ) -> tuple[dict[str, QTensor] | None, dict[str, QTensor]]:
    """A checkpoint's QTensors (None: none) as (the linears', the MoE experts')."""
    if preset is None:
        return None, {}
    experts = {n: q for n, q in preset.items() if ".experts." in n}
    return {n: q for n, q in preset.items() if n not in experts}, experts


@torch.no_grad()
def convert_row_experts(model: nn.Module, scope: nn.Module, experts: Mapping[str, QTensor],
                        hf_prefix: Callable[[str], str]) -> list[Fp8RowStackedExperts]:
    """The StackedExperts inside `scope` (one layer as it loads, or the model) whose HF tensors
    are in `experts` (a per-channel FP8 checkpoint's QTensors, fmt "fp8_row",
    lowprec/checkpoint_weights.py; `hf_prefix(module name in scope)` names them) converted to
    row-scaled float8 holding exactly those values and scales. A layer with some experts in FP8
    and some not, or an FP8 expert tensor no StackedExperts holds, is refused naming the tensor."""
    if not experts:
        return []
    for name, module in scope.named_modules():
        if type(module) is not StackedExperts:
            continue
        names = [f"{hf_prefix(name)}.{e}.{p}_proj.weight" for e in range(module.num_experts)
                 for p in ("gate", "up", "down")]
        held = [n in experts for n in names]
        if any(held) and not all(held):  # one stacked store per layer: all FP8 or all --dtype
            raise ValueError(f"{names[held.index(False)]}: stored unquantized by the checkpoint "
                             "while other experts of its layer are per-channel FP8; the row store "
                             "holds a layer's experts alike: serve the checkpoint with "
                             "--dequantize-checkpoint")
    modules = convert_fp8_experts(scope, experts.__contains__, hf_prefix, convert=_convert_rows,
                                  fmt="per-channel FP8")
    registry = Fp8RowExperts(modules) if modules else None
    for name, q in experts.items():
        view = model.weight_view(name)
        if registry is None or registry.owner(view) is None:
            raise ValueError(f"{name}: a per-channel FP8 expert weight outside the model's stacked "
                             "experts; serve the checkpoint with --dequantize-checkpoint")
        if q.fmt != ROW_FORMAT:
            raise ValueError(f"{name}: a {q.fmt} tensor where the row store holds per-row scales")
        module, parts = registry.parts(view)
        module.put(*parts[0], QTensor(q.fmt, q.values.to(view.device), q.scales.to(view.device),
                                      q.tile, q.shape))
    return modules  # type: ignore[return-value]


def _convert_rows(module: StackedExperts) -> None:
    """Row-scaled float8 storage for `module` (values written by `convert_row_experts` from the
    checkpoint, every tensor of the layer: no quantization here)."""
    e, two_i, h = module.w13.shape
    inter = two_i // 2
    dev, dtype = module.w13.device, module.w13.dtype
    module.__class__ = Fp8RowStackedExperts
    module.w13 = nn.Parameter(torch.empty(e, two_i, h, dtype=torch.float8_e4m3fn, device=dev),
                              requires_grad=False)
    module.w2 = nn.Parameter(torch.empty(e, h, inter, dtype=torch.float8_e4m3fn, device=dev),
                             requires_grad=False)
    module.register_buffer("w13_scale", torch.empty(e, 2, inter, 1, dtype=torch.float32, device=dev))
    module.register_buffer("w2_scale", torch.empty(e, h, 1, dtype=torch.float32, device=dev))
    module.compute_dtype = dtype
    module.act_fp8 = False
