"""The engine's weights in a low-precision format (`--quantization fp8_block|mxfp8|nvfp4|int4`).

Each covered projection keeps, per Hugging Face tensor it holds (q/k/v inside a fused qkv_proj,
gate/up inside gate_up_proj), that tensor's quantized values and scales (a QTensor from the one
quantizer), quantized from what the sender sent on every update: a tensor's blocks never straddle
another's rows. The forward quantizes its input per token in the same format and multiplies the
dequantized operands (emulated GEMM; the H200 path is `linear.fp8_block_mm` where it runs);
native fp8_block linears also take their input already quantized by the kernel that made
it (an Fp8Act, lowprec/fp8_act.py).
NVFP4 quantizes gate and up together (one outer scale for the fused GEMM): the first of the two
to arrive in an update waits for the other. INT4 is stored packed on every device (two values a
byte, uint8 [N, ceil(K/2)], and float32 group scales [N, ceil(K/128)]): its HF views are half as
wide as the tensors sent (`hf_shape` says the sent shape), and the forward is W4A16
(kernels/int4_gemm.py). Under fp8_block the MoE experts are stored in FP8 too
(lowprec/engine_experts.py), under int4 packed in INT4 (lowprec/experts_int4.py); the registry
answers for them all. Registered as `model.fp8_weights`,
the attribute the weight loader and the weight-check endpoints use. With static input scales
(`--fp8-activation-scheme static`, lowprec/engine_scales.py) fp8_block linears quantize their
input with the trainer's delayed-scaling function and the scale it sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from milepost.lowprec.contract import EXPERTS_SERVED, Contract
from milepost.lowprec.delayed import qdq_input
from milepost.lowprec.engine_experts import Fp8Experts, convert_fp8_experts
from milepost.lowprec.engine_scales import InputScales, attach_input_scales
from milepost.lowprec.experts_int4 import Int4Experts, convert_int4_experts
from milepost.lowprec.fp8_act import Fp8Act, SplitSum
from milepost.lowprec.linear import quantize_activation, quantize_weight_parts
from milepost.lowprec.quantize import INT4_GROUP, QTensor, dequantize, element_scale
from milepost.models.qwen3_moe import StackedExperts


class QuantizedLinear(nn.Linear):
    """nn.Linear in a low-precision format. Emulated: `weight` holds the dequantized values of
    its parts in the model dtype. Native (fp8_block on Hopper): `weight` is the float8 values
    and `weight_scale` the 128x128 tile scales; the GEMM runs in FP8 (kernels/fp8_gemm.py).
    INT4 (every device): `weight` is the packed uint8 nibbles, `weight_scale` the group scales,
    and, for a checkpoint with zero points (AWQ, asymmetric GPTQ) served as stored,
    `weight_zero` int8 [N, ceil(K/128)]: each group's zero point - 8 (QTensor.zeros), 0 once an
    update re-quantized the part with the symmetric quantizer."""

    qparts: list[tuple[int, int, QTensor]]  # (first row, rows, quantized tensor) per HF tensor
    qformat: str
    qjoint: bool  # nvfp4 gate_up_proj: its parts share one outer scale
    qfour: bool  # nvfp4 four-over-six: activations are quantized with it too
    native: bool
    weight_scale: torch.Tensor
    qstatic: bool = False  # fp8_block with static input scales (`input_scale`, engine_scales.py)
    input_scale: torch.Tensor  # float32 [parts], equal; 0 = none yet: 1 x 128 current blocks
    weight_zero: torch.Tensor | None  # int4 (a buffer, None without zero points): int8 [N, ceil(K/128)]
    # Native fp8_block: the kernel that makes this linear's input quantizes it too, handing an
    # Fp8Act (lowprec/fp8_act.py). A class switch only so benchmarks can measure both.
    fuse_act_quant: ClassVar[bool] = True
    # forward_unsummed may hand back a split decode GEMM's parts (lowprec/fp8_act.SplitSum). A
    # class switch only so benchmarks can measure both.
    leave_split_parts: ClassVar[bool] = True

    def takes_fp8_act(self) -> bool:
        """Whether its input may come as an Fp8Act: native dynamic fp8_block, the fusion on, and
        no hooks (an adapter's, say) that read the input tensor."""
        return (self.native and not self.qstatic and self.fuse_act_quant
                and not self._forward_hooks and not self._forward_pre_hooks)

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        if isinstance(x, Fp8Act):  # quantized by the kernel that made it (takes_fp8_act)
            from milepost.kernels.fp8_gemm import fp8_act_linear

            y = fp8_act_linear(x, self.weight, self.weight_scale)
            return y + self.bias if self.bias is not None else y
        if self.native:
            from milepost.kernels.fp8_gemm import fp8_block_linear, fp8_static_linear

            y = (fp8_static_linear(x, self.weight, self.weight_scale, self.input_scale[0])
                 if self.qstatic else fp8_block_linear(x, self.weight, self.weight_scale))
            return y + self.bias if self.bias is not None else y
        if self.qformat == "int4":  # weight-only (W4A16): activations stay in the model dtype
            from milepost.kernels.int4_gemm import int4_linear

            return int4_linear(x, self.weight, self.weight_scale, self.in_features, self.bias,
                               self.weight_zero)
        if self.qstatic:  # the trainer's delayed-scaling quantizer with the scale it sent
            return F.linear(qdq_input(x, self.input_scale[0]), self.weight, self.bias)
        return F.linear(quantize_activation(x, self.qformat, self.qfour), self.weight, self.bias)

    def forward_unsummed(self, x: torch.Tensor | Fp8Act) -> torch.Tensor | SplitSum:
        """forward(x), except that a split-K decode GEMM hands back its parts (a SplitSum) for
        the caller's next kernel to sum (lowprec/fp8_act.unsummed)."""
        if not (self.native and self.leave_split_parts) or self.qstatic or self.bias is not None:
            return self.forward(x)
        from milepost.kernels.fp8_gemm import fp8_act_linear, fp8_block_linear

        if isinstance(x, Fp8Act):
            return fp8_act_linear(x, self.weight, self.weight_scale, unsummed=True)
        return fp8_block_linear(x, self.weight, self.weight_scale, unsummed=True)

    def put(self, j: int, q: QTensor) -> None:
        """Write part j's quantized values (native: into the fp8 weight and tile scales, the
        part then viewing them; emulated: its dequantized values into the weight)."""
        row, rows, _ = self.qparts[j]
        if self.qformat == "int4":  # packed rows and their group scales; the part views them
            self.weight[row:row + rows].copy_(q.values)
            self.weight_scale[row:row + rows].copy_(q.scales)
            zeros = None
            if self.weight_zero is not None:  # a symmetric part (an update's) has zero points 0
                zeros = self.weight_zero[row:row + rows]
                if q.zeros is not None:
                    zeros.copy_(q.zeros)
                else:
                    zeros.zero_()
            elif q.zeros is not None:
                raise ValueError("an INT4 part with zero points in a linear built without them")
            q = QTensor(q.fmt, self.weight[row:row + rows], self.weight_scale[row:row + rows],
                        q.tile, q.shape, zeros=zeros)
        elif self.native:
            self.weight[row:row + rows].copy_(q.values)
            tiles = slice(row // 128, row // 128 + q.scales.shape[0])
            self.weight_scale[tiles].copy_(q.scales)
            q = QTensor(q.fmt, self.weight[row:row + rows], self.weight_scale[tiles], q.tile, q.shape)
        else:
            self.weight[row:row + rows].copy_(dequantize(q))
        self.qparts[j] = (row, rows, q)


class QuantizedWeights:
    """Where each HF tensor's quantized values live; `write` re-quantizes on arrival."""

    def __init__(self, modules: dict[int, QuantizedLinear], names: dict[tuple[int, int], str],
                 contract: Contract, source_dtype: torch.dtype) -> None:
        self.source_dtype = source_dtype
        self.contract = contract
        self.format = contract.rollout
        self._modules = list(modules.values())
        self._by_storage = modules
        self._names = names  # (id(module), first row) -> HF name, for messages
        self._pending: dict[int, dict[int, torch.Tensor]] = {}  # nvfp4 gate/up halves
        self.experts: Fp8Experts | None = None  # MoE experts: fp8_block or int4 (Int4Experts)
        self.input_scales: InputScales | None = None  # --fp8-activation-scheme static

    def owner(self, view: torch.Tensor) -> object | None:
        """The quantized linear (or the FP8 experts) `view` belongs to; None: not quantized."""
        hit = self.experts.owner(view) if self.experts is not None else None
        return hit if hit is not None else self._linear(view)

    def _linear(self, view: torch.Tensor) -> QuantizedLinear | None:
        ptr = view.untyped_storage().data_ptr()
        module = self._by_storage.get(ptr)
        if module is None or module.weight.untyped_storage().data_ptr() != ptr:
            # Weights move (released to host and resumed: new storages): map them again.
            self._by_storage = {m.weight.untyped_storage().data_ptr(): m for m in self._modules}
            module = self._by_storage.get(ptr)
        return module

    def _part(self, view: torch.Tensor) -> tuple[QuantizedLinear, int]:
        module = self._linear(view)
        if module is None:
            raise KeyError("not a view of a quantized linear weight")
        row_bytes = module.weight.stride(0) * module.weight.element_size()
        first = (view.data_ptr() - module.weight.data_ptr()) // row_bytes
        for i, (row, rows, _) in enumerate(module.qparts):
            if row == first and rows == view.shape[0]:
                return module, i
        raise KeyError(f"rows {first}..{first + view.shape[0]} are not one tensor of this linear")

    @torch.no_grad()
    def write(self, view: torch.Tensor, src: torch.Tensor) -> None:
        """Quantize `src` (the HF tensor `view` holds) into its part and refresh the weights."""
        if self.experts is not None and self.experts.owner(view) is not None:
            self.experts.write(view, src)
            return
        module, i = self._part(view)
        if module.qjoint:  # gate and up share one outer scale: wait until both halves arrived
            pending = self._pending.setdefault(id(module), {})
            pending[i] = src.detach().to(view.device, torch.float32, copy=True)
            if len(pending) < len(module.qparts):
                return
            srcs = [pending[j] for j in range(len(module.qparts))]
            del self._pending[id(module)]
            indices = list(range(len(module.qparts)))
        else:
            srcs, indices = [src.to(view.device)], [i]
        names = [self._names.get((id(module), module.qparts[j][0]), "weight") for j in indices]
        for j, q in zip(indices, quantize_weight_parts(srcs, module.qformat, self.contract, names)):
            module.put(j, q)

    def dequantized(self, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 values, float32 per-element dequantization scales) of the tensor `view`."""
        if self.experts is not None and self.experts.owner(view) is not None:
            return self.experts.dequantized(view)
        module, i = self._part(view)
        q = module.qparts[i][2]
        return dequantize(q), element_scale(q)

    def hf_shape(self, view: torch.Tensor) -> tuple[int, ...]:
        """The shape of the HF tensor `view` holds, as senders send it (a packed INT4 view has
        ceil(K/2) byte columns for K values)."""
        if self.experts is not None and self.experts.owner(view) is not None:
            return self.experts.hf_shape(view)
        module = self._linear(view)
        if module is None or module.qformat != "int4":
            return tuple(view.shape)
        return (view.shape[0], module.in_features)

    def format_of(self, view: torch.Tensor) -> str:
        if self.experts is not None and self.experts.owner(view) is not None:
            return self.experts.fmt
        return self._part(view)[0].qformat


@torch.no_grad()
def store_quantized(model: nn.Module, contract: Contract, static_scales: bool = False,
                    preset: dict[str, QTensor] | None = None, w8a8_experts: bool = False
                    ) -> QuantizedWeights:
    """Quantize the covered linears of `model` (after fuse_projections) in place, per HF tensor,
    in the format `contract` gives each (bf16 overrides stay as they are); `static_scales`: the
    fp8_block linears take static input scales (engine_scales.py); native ones then run the
    block-scaled GEMM with every block scale the static one (kernels/fp8_gemm.py). `preset`:
    fp8_block QTensors by HF name (an FP8 checkpoint's own values and scales), stored as they
    are instead of quantizing the model's (dequantized) weights again; the weights must hold
    their dequantized values already (registry.load_native writes them), which an emulated
    linear keeps as its weight. `w8a8_experts`: fp8_block MoE experts quantize their inputs too
    (--fp8-w8a8-experts)."""
    # The model dtype (what senders send): taken before the experts are converted.
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    build = StoreBuilder(contract, dtype, preset, w8a8_experts)
    build.add(model, model, model.hf_weight_names(), lambda name: "model." + name[name.find("layers."):])
    return build.finish(model, static_scales)


class StoreBuilder:
    """`store_quantized` in steps: `add` quantizes the covered tensors of one part of the model
    (all of it, or one decoder layer as it loads: lowprec/engine_load.py), `finish` makes the
    store. Each HF tensor is quantized on its own, so the parts' order changes no bit."""

    def __init__(self, contract: Contract, source_dtype: torch.dtype,
                 preset: dict[str, QTensor] | None = None, w8a8_experts: bool = False) -> None:
        self.contract = contract
        self.w8a8_experts = w8a8_experts
        self.source_dtype = source_dtype
        self.preset = preset or {}
        self.modules: dict[int, QuantizedLinear] = {}
        self.names: dict[tuple[int, int], str] = {}
        self.experts: list[StackedExperts] = []

    @torch.no_grad()
    def add(self, model: nn.Module, scope: nn.Module, names: list[str],
            expert_prefix: Callable[[str], str]) -> None:
        """Quantize the linears and experts inside `scope` that hold the HF tensors `names`;
        `expert_prefix(module name in scope)`: the HF prefix of that StackedExperts' tensors."""
        contract = self.contract
        by_module: dict[int, list[tuple[int, int, str]]] = {}
        modules: dict[int, nn.Linear] = {}
        linears = [m for m in scope.modules() if type(m) is nn.Linear]
        for name in names:
            fmt = contract.tensor_format(name, "rollout")
            if fmt == "bf16" or ".experts." in name:  # experts: convert_fp8_experts, below
                continue
            view = model.weight_view(name)
            module = next((m for m in linears
                           if m.weight.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()),
                          None)
            if module is None:
                continue
            row_bytes = module.weight.stride(0) * module.weight.element_size()
            first = (view.data_ptr() - module.weight.data_ptr()) // row_bytes
            by_module.setdefault(id(module), []).append((first, view.shape[0], name))
            modules[id(module)] = module
        if contract.rollout in EXPERTS_SERVED:
            def quantized(n: str) -> bool:
                return contract.tensor_format(n, "rollout") == contract.rollout

            if contract.rollout == "int4":
                self.experts += convert_int4_experts(scope, quantized, expert_prefix, stored=self.preset)
            else:
                self.experts += convert_fp8_experts(scope, quantized, expert_prefix, stored=self.preset,
                                                    act_fp8=self.w8a8_experts)
        for key, parts in by_module.items():
            parts.sort()
            module = _quantize_linear(modules[key], parts, contract, self.preset)
            self.modules[module.weight.untyped_storage().data_ptr()] = module
            self.names.update({(id(module), row): n for row, _, n in parts})

    def finish(self, model: nn.Module, static_scales: bool = False) -> QuantizedWeights:
        """The store over every part added, registered as `model.fp8_weights`."""
        contract = self.contract
        registry = Int4Experts if contract.rollout == "int4" else Fp8Experts
        experts = registry(self.experts) if self.experts else None  # type: ignore[arg-type]
        if not self.modules and experts is None:
            raise ValueError(f"--quantization {contract.rollout}: {type(model).__name__} has no "
                             "projection linears left to quantize (check --precision-override)")
        store = QuantizedWeights(self.modules, self.names, contract, self.source_dtype)
        store.experts = experts
        self.put_preset_experts(model, experts, list(self.preset))
        if static_scales:
            store.input_scales = attach_input_scales(model, [
                (m, [self.names[(id(m), row)] for row, _, _ in m.qparts])
                for m in self.modules.values() if m.qformat == "fp8_block"])
        model.fp8_weights = store
        return store

    def put_preset_experts(self, model: nn.Module, experts: Fp8Experts | None, names: list[str]) -> None:
        """The checkpoint's FP8 / INT4 experts among `names` (in `preset`) into `experts`, tensor
        by tensor (`finish` for the whole model; a layerwise start for each layer as it loads).
        INT4 zero points (AWQ, asymmetric GPTQ / compressed-tensors) go with them."""
        for name in names:
            q = self.preset.get(name)
            view = model.weight_view(name) if q is not None and experts is not None and ".experts." in name else None
            if view is not None and experts.owner(view) is not None and q.fmt == experts.fmt:
                module, parts = experts.parts(view)
                module.put(*parts[0], _on(q, module.w13.device))


def _quantize_linear(module: nn.Linear, parts: list[tuple[int, int, str]], contract: Contract,
                     preset: dict[str, QTensor]) -> QuantizedLinear:
    """`module` (holding the HF tensors `parts`: first row, rows, name) as a QuantizedLinear."""
    covered = sum(rows for _, rows, _ in parts)
    if covered != module.weight.shape[0]:
        raise ValueError(f"{parts[0][2]}: its fused linear mixes quantized and bf16 tensors; "
                         "override all tensors of one fused projection alike")
    fmt = contract.tensor_format(parts[0][2], "rollout")
    module.__class__ = QuantizedLinear
    module.qformat = fmt
    module.weight.requires_grad_(False)
    w = module.weight
    joint = fmt == "nvfp4" and any(n.endswith("gate_proj.weight") for _, _, n in parts)
    module.qjoint = joint
    module.qfour = contract.four_over_six
    # A preset part (an FP8 checkpoint's own tensor) is stored as it is: no float copy of
    # the loaded weights, no quantization.
    qs = (quantize_weight_parts([w[row:row + rows].float() for row, rows, _ in parts], fmt,
                                contract, [n for _, _, n in parts]) if joint else
          [_on(preset[n], w.device) if n in preset and preset[n].fmt == fmt
           else quantize_weight_parts([w[row:row + rows].float()], fmt, contract, [n])[0]
           for row, rows, n in parts])
    module.qparts = [(row, rows, None) for row, rows, _ in parts]  # type: ignore[misc]
    module.native = _native(module, fmt, parts)
    if fmt == "int4":  # packed on every device: a quarter of bf16's bytes (plus scales)
        n, k = module.weight.shape
        dev = module.weight.device
        module.weight = nn.Parameter(torch.empty(n, -(-k // 2), dtype=torch.uint8, device=dev),
                                     requires_grad=False)
        module.register_buffer("weight_scale", torch.empty(
            n, -(-k // INT4_GROUP), dtype=torch.float32, device=dev))
        # AWQ / asymmetric GPTQ served as stored: a zero point per group (None: symmetric).
        module.register_buffer("weight_zero", torch.zeros(n, -(-k // INT4_GROUP), dtype=torch.int8,
                                                          device=dev)
                               if any(q.zeros is not None for q in qs) else None)
        if dev.type == "cuda":  # probe the W4A16 kernel now, not inside a graph capture
            from milepost.kernels.int4_gemm import kernel_ok

            kernel_ok(dev)
    elif module.native:  # the weight becomes its fp8 values; bytes read per step halve
        n, k = module.weight.shape
        module.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn,
                                                 device=module.weight.device), requires_grad=False)
        module.register_buffer("weight_scale", torch.empty(
            -(-n // 128), -(-k // 128), dtype=torch.float32, device=module.weight.device))
    for j, (q, (row, rows, n)) in enumerate(zip(qs, parts)):
        if fmt == "fp8_block" and n in preset and not module.native:
            module.qparts[j] = (row, rows, q)  # the loader wrote dequantize(q) there already
        else:
            module.put(j, q)
    return module


def _on(q: QTensor, device: torch.device) -> QTensor:
    return QTensor(q.fmt, q.values.to(device), q.scales.to(device), q.tile, q.shape,
                   zeros=q.zeros.to(device) if q.zeros is not None else None)


def _native(module: nn.Linear, fmt: str, parts: list[tuple[int, int, str]]) -> bool:
    """FP8 GEMMs where the device has them and every part's tiles are whole (no tile spans two
    HF tensors, K divides into 128-wide blocks); elsewhere emulated, with the same values."""
    w = module.weight
    if fmt != "fp8_block" or w.device.type != "cuda" or w.shape[1] % 128:
        return False
    if any(row % 128 or rows % 128 for row, rows, _ in parts):
        return False
    from milepost.kernels.fp8_gemm import block_backend

    return torch.cuda.get_device_capability(w.device) >= (9, 0) and block_backend(w.device) != "emulated"
