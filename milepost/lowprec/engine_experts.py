"""The engine's MoE experts in FP8 blockwise (`--quantization fp8_block`): stacked expert weights
stored as float8_e4m3 with one float32 scale per 128 x 128 tile of each Hugging Face tensor
(`experts.N.gate_proj` / `up_proj` / `down_proj`), quantized by the one quantizer at load and on
every weight update.

Weights only (W8A16): expert activations stay in the model dtype; the dense linears' 1 x 128
activation quantization does not apply here. On CUDA (bf16/fp16, inference) the fused FP8 MoE
kernels (kernels/fused_moe_fp8.py) read the fp8 values and scales; every other path (the CPU
loop, fp32, anything outside inference mode) runs StackedExperts' own forward on the dequantized
weights, so values are the format's everywhere. Per-channel FP8 checkpoints' experts (one scale
per row) are this class with row scales: lowprec/experts_fp8_row.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from milepost.lowprec.quantize import FP8_TILE, QTensor, dequantize, element_scale, quantize
from milepost.models.qwen3_moe import StackedExperts

log = logging.getLogger(__name__)
# float32 bytes of the experts quantized per call at load: bounds the quantizer's temporaries
# (a few copies of the chunk), which sit beside the served model during a layerwise start.
_CHUNK_BYTES = 64 * 2**20


def _tiles(n: int) -> int:
    return -(-n // FP8_TILE)


class Fp8StackedExperts(StackedExperts):
    """StackedExperts whose `w13` / `w2` are float8_e4m3 (class swapped in by `store_fp8_experts`).

    w13_scale: [E, 2, ceil(I/128), ceil(H/128)] (gate's tiles, then up's), w2_scale:
    [E, ceil(H/128), ceil(I/128)]; compute_dtype: the model dtype the weights arrive in."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    compute_dtype: torch.dtype
    act_fp8: bool  # W8A8: inputs quantized per 1 x 128 too (--fp8-w8a8-experts)
    row_scales = False  # scales per row, [E, 2, I, 1] / [E, H, 1] (experts_fp8_row.py)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized (model dtype): for the paths that do not read fp8 themselves."""
        return (self.dequantize_w13().to(self.compute_dtype),
                self.dequantize_w2().to(self.compute_dtype))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
                and torch.is_inference_mode_enabled()):
            from milepost.kernels import fused_moe_fp8 as f8  # triton: imported on GPU only

            cfg = f8.config_for(x.shape[0], self.num_experts, self.w13.shape[2], self.intermediate,
                                ids.shape[1])
            return f8.fused_expert_mlp_fp8(x, ids, weights, self.w13, self.w13_scale, self.w2,
                                           self.w2_scale, cfg, self.act_fp8, self.row_scales)
        if self.act_fp8:
            return self._loop_a8(x, ids, weights)
        return super().forward(x, ids, weights)

    def _loop_a8(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """W8A8 off the fused path: the per-pair loop with tokens and activation rows quantized
        per 1 x 128 (the kernels' rounding points: gate / up and silu * up in the model dtype)."""
        from milepost.lowprec.linear import qdq

        w13, w2 = self.expert_weights()
        xq, k, inter = qdq(x, "fp8_block"), ids.shape[1], self.intermediate
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat, flat_w = ids.reshape(-1), weights.reshape(-1)
        for e in flat.unique().tolist():
            pairs = (flat == e).nonzero()[:, 0]
            h = xq.index_select(0, pairs // k) @ w13[e].t()
            act = qdq((F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype), "fp8_block")
            y = (act @ w2[e].t()).float() * flat_w.index_select(0, pairs).float()[:, None]
            out.index_add_(0, pairs // k, y.to(x.dtype).float())
        return out.to(x.dtype)

    def dequantize_w13(self) -> torch.Tensor:
        """float32 [E, 2I, H]: each HF tensor's values times its tiles' scales."""
        e, two_i, h = self.w13.shape
        s = self.w13_scale.repeat_interleave(FP8_TILE, 2)[:, :, :two_i // 2]
        s = s.repeat_interleave(FP8_TILE, 3)[..., :h].reshape(e, two_i, h)
        return self.w13.float() * s

    def dequantize_w2(self) -> torch.Tensor:
        """float32 [E, H, I]."""
        _, h, i = self.w2.shape
        s = self.w2_scale.repeat_interleave(FP8_TILE, 1)[:, :h].repeat_interleave(FP8_TILE, 2)[..., :i]
        return self.w2.float() * s

    # -- one HF tensor: (expert, which) with which 0 = gate, 1 = up, 2 = down ------------------

    def qtensor(self, e: int, which: int) -> QTensor:
        """The quantized HF tensor as the quantizer returned it (views of the stored values)."""
        inter = self.intermediate
        if which == 2:
            values, scales = self.w2[e], self.w2_scale[e]
        else:
            values, scales = self.w13[e, which * inter:(which + 1) * inter], self.w13_scale[e, which]
        return QTensor("fp8_block", values, scales, (FP8_TILE, FP8_TILE), tuple(values.shape))

    def put(self, e: int, which: int, q: QTensor) -> None:
        dst = self.qtensor(e, which)
        dst.values.copy_(q.values)
        dst.scales.copy_(q.scales)


class Fp8Experts:
    """The model's FP8 experts, found from a weight view (one HF tensor, or a whole stacked
    parameter under transformers 5's fused names): where to write, what to report. The INT4
    experts' registry is this one with their stored dtype and format (lowprec/experts_int4.py)."""

    stored_dtype = torch.float8_e4m3fn
    fmt = "fp8_block"

    def __init__(self, modules: list[Fp8StackedExperts]) -> None:
        self._modules = modules
        self._by_storage: dict[int, tuple[Fp8StackedExperts, str]] = {}

    def owner(self, view: torch.Tensor) -> tuple[Fp8StackedExperts, str] | None:
        if view.dtype != self.stored_dtype:
            return None
        first = self._modules[0]
        if self._by_storage.get(first.w13.untyped_storage().data_ptr(), (None,))[0] is not first:
            # Weights move together (released to host and resumed: new storages): map them again.
            self._by_storage = {getattr(m, p).untyped_storage().data_ptr(): (m, p)
                                for m in self._modules for p in ("w13", "w2")}
        return self._by_storage.get(view.untyped_storage().data_ptr())

    def parts(self, view: torch.Tensor) -> tuple[Fp8StackedExperts, list[tuple[int, int]]]:
        """The (expert, which) tensors `view` covers, in its row order."""
        hit = self.owner(view)
        if hit is None:
            raise KeyError(f"not a view of {self.fmt} expert weights")
        module, param = hit
        full = getattr(module, param)
        e_bytes = full.stride(0) * full.element_size()
        first = view.data_ptr() - full.data_ptr()
        e, rest = divmod(first, e_bytes)
        inter = module.intermediate
        if view.dim() == 3 and rest == 0 and view.shape == full.shape:  # a fused name: every expert
            whiches = (0, 1) if param == "w13" else (2,)
            return module, [(i, w) for i in range(full.shape[0]) for w in whiches]
        if param == "w2" and rest == 0 and tuple(view.shape) == tuple(full.shape[1:]):
            return module, [(e, 2)]
        if param == "w13" and view.shape[0] == inter and rest in (0, inter * full.stride(1) * full.element_size()):
            return module, [(e, 0 if rest == 0 else 1)]
        raise KeyError(f"bytes {first}.. of {param} are not one expert tensor")

    @torch.no_grad()
    def write(self, view: torch.Tensor, src: torch.Tensor, name: str = "expert weight") -> None:
        """Quantize `src` (what `view` holds, in HF layout) tensor by tensor into values + scales."""
        module, parts = self.parts(view)
        src = src.to(view.device)
        if len(parts) > 1:  # [E, 2I, H] or [E, H, I]: each expert's gate / up / down on its own
            inter = module.intermediate
            for e, which in parts:
                part = src[e] if which == 2 else src[e, which * inter:(which + 1) * inter]
                module.put(e, which, self.quantize_part(part, name))
            return
        e, which = parts[0]
        module.put(e, which, self.quantize_part(src, name))

    def quantize_part(self, src: torch.Tensor, name: str) -> QTensor:
        """One HF tensor quantized as this store holds it (the one quantizer, in `fmt`)."""
        return quantize(src, self.fmt, "weight", name=name)

    def hf_shape(self, view: torch.Tensor) -> tuple[int, ...]:
        """The shape of the tensor(s) `view` holds as senders send them (FP8: the view's)."""
        return tuple(view.shape)

    def dequantized(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 values, float32 per-element scales) of the tensor(s) `view` holds."""
        module, parts = self.parts(view)
        qs = [module.qtensor(e, w) for e, w in parts]
        values = [dequantize(q) for q in qs]
        scales = [element_scale(q) for q in qs]
        if len(parts) == 1:
            return values[0], scales[0]
        per = len(parts) // module.num_experts  # 2: gate, up rows of each expert
        shape = self.hf_shape(view)
        return (torch.stack([torch.cat(values[i:i + per]) for i in range(0, len(values), per)]).reshape(shape),
                torch.stack([torch.cat(scales[i:i + per]) for i in range(0, len(scales), per)]).reshape(shape))


@torch.no_grad()
def store_fp8_experts(model: nn.Module, quantized: Callable[[str], bool]) -> Fp8Experts | None:
    """Convert the StackedExperts of `model` whose HF tensors `quantized(hf_name)` says are
    fp8_block, in place (a layer's experts all alike: a mix is refused naming the layer);
    None when no layer has FP8 experts. LoRA-adapted experts are not plain StackedExperts and
    are left alone (the adapter layer refuses quantized bases)."""
    modules = convert_fp8_experts(model, quantized, lambda name: "model." + name[name.find("layers."):])
    return Fp8Experts(modules) if modules else None


@torch.no_grad()
def convert_fp8_experts(scope: nn.Module, quantized: Callable[[str], bool],
                        hf_prefix: Callable[[str], str],
                        convert: Callable[..., None] | None = None,
                        fmt: str = "fp8_block", stored: Mapping[str, QTensor] | None = None,
                        act_fp8: bool = False) -> list[Fp8StackedExperts]:
    """`store_fp8_experts` for the StackedExperts inside `scope` (the whole model, or one layer as
    it loads), `hf_prefix(module name in scope)` naming their HF tensors; the converted ones.
    `convert` / `fmt`: another format's conversion (lowprec/experts_int4.py). `stored`: the
    checkpoint's QTensors by HF name, which the caller puts in afterwards (StoreBuilder's preset);
    a module whose every tensor is there in `fmt` gets its buffers without quantizing the loaded weights
    (they would be overwritten: a 30B-A3B INT4 checkpoint started in 25.8 s against 4.2 s from
    bf16 on an H200 while its experts were quantized first). `act_fp8`: the converted experts
    quantize their inputs too (W8A8, fp8_block only)."""
    modules: list[Fp8StackedExperts] = []
    for name, module in list(scope.named_modules()):
        if type(module) is not StackedExperts:
            continue
        prefix = hf_prefix(name) + "."
        names = [f"{prefix}{e}.{p}_proj.weight" for e in range(module.num_experts)
                 for p in ("gate", "up", "down")]
        flags = {quantized(n) for n in names}
        if flags == {False}:
            continue
        if len(flags) > 1:
            raise ValueError(f"{prefix}*: some of this layer's expert tensors are {fmt} and some "
                             "bf16; override all experts of one layer alike ('layers.A-B=bf16' or "
                             "'*.experts.*=bf16')")
        if stored and all(n in stored and stored[n].fmt == fmt for n in names):
            (convert or _convert)(module, from_weights=False)
        else:
            (convert or _convert)(module)
        if act_fp8:  # fp8_block only (server_args_precision refuses the other stores)
            hidden = module.w13.shape[2]
            if hidden % FP8_TILE or module.intermediate % FP8_TILE:
                raise ValueError(f"{prefix}*: --fp8-w8a8-experts quantizes the experts' inputs in "
                                 f"1 x {FP8_TILE} blocks; hidden size {hidden} and "
                                 f"moe_intermediate_size {module.intermediate} must both divide "
                                 f"by {FP8_TILE}: drop --fp8-w8a8-experts for this model")
            module.act_fp8 = True
        modules.append(module)  # type: ignore[arg-type]
    return modules


def _convert(module: StackedExperts, from_weights: bool = True) -> None:
    """In place: the stacked weights as float8 tiles and scales (from_weights=False: the buffers only,
    for the checkpoint's own values to be put in)."""
    e, two_i, h = module.w13.shape
    inter = two_i // 2
    dev, dtype = module.w13.device, module.w13.dtype
    w13 = torch.empty(e, two_i, h, dtype=torch.float8_e4m3fn, device=dev)
    w2 = torch.empty(e, h, inter, dtype=torch.float8_e4m3fn, device=dev)
    s13 = torch.empty(e, 2, _tiles(inter), _tiles(h), dtype=torch.float32, device=dev)
    s2 = torch.empty(e, _tiles(h), _tiles(inter), dtype=torch.float32, device=dev)
    # Tiles of stacked tensors are each tensor's own tiles when every tensor starts on a tile
    # row: quantize a chunk of experts per call then (the same bits, fewer launches).
    parts = ((module.w13.detach(), w13, s13, inter), (module.w2.detach(), w2, s2, h))
    for src, dst, scale, rows in parts if from_weights else ():
        per = src.shape[1] // rows  # HF tensors per expert in this parameter
        step = max(1, _CHUNK_BYTES // (src[0].numel() * 4)) if rows % FP8_TILE == 0 else 1
        for first in range(0, e, step):
            chunk = src[first:first + step]
            if step == 1:
                qs = [quantize(chunk[0, j * rows:(j + 1) * rows], "fp8_block", "weight")
                      for j in range(per)]
                dst[first].copy_(torch.cat([q.values for q in qs]))
                scale[first].copy_(torch.stack([q.scales for q in qs]).reshape(scale[first].shape))
            else:
                q = quantize(chunk.reshape(-1, chunk.shape[-1]), "fp8_block", "weight")
                n = chunk.shape[0]
                dst[first:first + n].copy_(q.values.reshape(chunk.shape))
                scale[first:first + n].copy_(q.scales.reshape(scale[first:first + n].shape))
    module.__class__ = Fp8StackedExperts
    module.w13 = nn.Parameter(w13, requires_grad=False)
    module.w2 = nn.Parameter(w2, requires_grad=False)
    module.register_buffer("w13_scale", s13)
    module.register_buffer("w2_scale", s2)
    module.compute_dtype = dtype
    module.act_fp8 = False  # convert_fp8_experts sets it under --fp8-w8a8-experts
