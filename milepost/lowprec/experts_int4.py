"""INT4 MoE experts (`--precision int4`): the trainer's fake-quant experts and the engines' packed
store, one quantizer between them (quantize.py's int4: symmetric, one float32 scale per 128
weights of a row, values -8..7).

A group runs along one row, so quantizing a stacked parameter row by row (the fused gate/up
[E, 2I, H], the down [E, H, I]) gives every Hugging Face tensor (`experts.N.gate_proj` ...) the
bits it gets on its own: the trainer, the engine's load, its updates and a checkpoint
conversion all agree without splitting the stacks.

Trainer (QAT): `Int4QatExperts.expert_weights` is w + (qdq(w) - w).detach(): the forward runs on
the INT4 values, the gradient passes straight through to the master weights (the dense INT4
linears' rule, lowprec/linear.py).

Engine: `Int4StackedExperts` holds w13 as uint8 [E, 2I, ceil(H/2)] (two's-complement nibbles,
element 2i low) with float32 scales [E, 2I, ceil(H/128)], and w2 as [E, H, ceil(I/2)] with
[E, H, ceil(I/128)]: re-packed from what the sender sent on every update, every transport
(`Int4Experts.write`, through the store the weight loader calls). The forward is W4A16: the
weights are dequantized (nibble times scale in float32, cast once to the model dtype: the
trainer's fake-quant bits) and the bf16 expert paths multiply them. On CUDA inference up to
fused_moe_int4.MAX_TOKENS tokens (decode) the fused W4A16 MoE kernels (kernels/fused_moe_int4.py,
probed at start) read the packed bytes and scales and dequantize in registers: the bf16 fused
kernel's tiles on the same weights, at a quarter of its expert bytes; no host sync, so CUDA graphs
capture them. Where their probe failed, decode gathers the routed experts, still packed, and
dequantizes one copy per pair (kernels/int4_gemm.py's Triton dequantization), then the bf16
experts run. Past MAX_TOKENS (prefill: the GEMMs dominate) every expert of the layer is
dequantized into a temporary per forward.

Zero points (an AWQ, asymmetric GPTQ or asymmetric compressed-tensors checkpoint served as
stored): `w13_zero` / `w2_zero` int8, laid out as the scales (each group's zero point - 8, as the
dense store's `weight_zero`), allocated when the first tensor with zero points is put (None
until then: symmetric). Every path computes (value - zero) * scale in float32 (an exact
difference, one rounding); an update re-quantizes with the symmetric quantizer and sets that
tensor's zero points to 0, as the dense store does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from milepost.lowprec.engine_experts import _CHUNK_BYTES, Fp8Experts, convert_fp8_experts
from milepost.lowprec.formats import INT4_GROUP
from milepost.lowprec.linear import qdq
from milepost.lowprec.quantize import QTensor, quantize
from milepost.models.qwen3_moe import StackedExperts


def dequantize_packed(packed: torch.Tensor, scales: torch.Tensor, k: int, dtype: torch.dtype,
                      zeros: torch.Tensor | None = None) -> torch.Tensor:
    """[.., N, ceil(k/2)] packed bytes and [.., N, ceil(k/128)] scales (and int8 zero points
    shaped as the scales, or None) -> [.., N, k] in `dtype`: quantize.dequantize's float32
    product, (v - zero) * scale, cast once (torch; no Triton import on CPU)."""
    from milepost.lowprec.elements import unpack_int4

    def part(p: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        v = unpack_int4(p, k).float()
        if z is not None:  # an exact float32 difference of small integers
            v = v - z.float().repeat_interleave(INT4_GROUP, -1)[..., :k]
        return (v * s.repeat_interleave(INT4_GROUP, -1)[..., :k]).to(dtype)

    if packed.dim() < 3:
        return part(packed, scales, zeros)
    # A few experts at a time: the float32 temporaries of a whole stack (~10 GB at the 30B-A3B
    # shape) would sit beside the model; each group's product is the same either way.
    step = _experts_per_chunk(packed[0].numel() * 2)
    return torch.cat([part(packed[i:i + step], scales[i:i + step],
                           zeros[i:i + step] if zeros is not None else None)
                      for i in range(0, packed.shape[0], step)])


def _experts_per_chunk(values_per_expert: int) -> int:
    return max(1, _CHUNK_BYTES // (values_per_expert * 4))


class Int4StackedExperts(StackedExperts):
    """StackedExperts whose `w13` / `w2` are packed INT4 (class swapped in by
    `convert_int4_experts`); `hidden`: H, `compute_dtype`: the model dtype the weights arrived in;
    `w13_zero` / `w2_zero`: int8 zero points shaped as the scales (None: symmetric)."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    w13_zero: torch.Tensor | None
    w2_zero: torch.Tensor | None
    compute_dtype: torch.dtype
    hidden: int

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every expert dequantized (model dtype): the paths that do not read INT4 themselves."""
        return (self._dequantize(self.w13, self.w13_scale, self.hidden, self.w13_zero),
                self._dequantize(self.w2, self.w2_scale, self.intermediate, self.w2_zero))

    def _dequantize(self, packed: torch.Tensor, scales: torch.Tensor, k: int,
                    zeros: torch.Tensor | None) -> torch.Tensor:
        if packed.is_cuda:
            from milepost.kernels.int4_gemm import dequantize_int4_triton, kernel_ok

            if kernel_ok(packed.device):  # one kernel over [E * N, K]: the same bits as torch's
                e, n, kp = packed.shape
                flat_z = zeros.reshape(e * n, -1) if zeros is not None else None
                return dequantize_int4_triton(packed.reshape(e * n, kp), scales.reshape(e * n, -1),
                                              k, self.compute_dtype, flat_z).reshape(e, n, k)
        return dequantize_packed(packed, scales, k, self.compute_dtype, zeros)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from milepost.kernels.grouped_experts import grouped_available

        if grouped_available(x):
            from milepost.kernels import fused_moe_int4 as f4  # triton: imported on GPU only

            if ids.shape[0] <= f4.MAX_TOKENS and f4.kernel_ok(x.device):
                cfg = f4.config_for(x.shape[0], self.num_experts, self.hidden, self.intermediate,
                                    ids.shape[1])
                return f4.fused_expert_mlp_int4(x, ids, weights, self.w13, self.w13_scale, self.w2,
                                                self.w2_scale, cfg, self.w13_zero, self.w2_zero)
            if ids.numel() < self.num_experts:  # the kernels failed their probe: copies at decode
                return self._routed_only(x, ids, weights)
        return super().forward(x, ids, weights)

    def _routed_only(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from milepost.kernels.grouped_experts import fused_config, grouped_expert_mlp

        pairs, w13, w2 = self.routed_weights(ids)
        cfg = fused_config(x, pairs, w13, w2)
        if cfg is not None:
            from milepost.kernels.fused_moe import fused_expert_mlp

            return fused_expert_mlp(x, pairs, weights, w13, w2, cfg)
        return grouped_expert_mlp(x, pairs, weights, w13, w2)

    def routed_weights(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode without the fused INT4 kernels: each (token, slot) pair gets its own dequantized copy of its expert (a gather
        of packed bytes, then the dequantization) and the pairs become the experts: (pair ids
        shaped like `ids`, w13 [T*k, 2I, H], w2 [T*k, H, I]). No host sync."""
        flat = ids.reshape(-1)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.index_select(0, flat) if t is not None else None

        w13 = self._dequantize(pick(self.w13), pick(self.w13_scale), self.hidden, pick(self.w13_zero))
        w2 = self._dequantize(pick(self.w2), pick(self.w2_scale), self.intermediate, pick(self.w2_zero))
        return torch.arange(flat.numel(), device=ids.device).reshape(ids.shape), w13, w2

    # -- one HF tensor: (expert, which) with which 0 = gate, 1 = up, 2 = down ------------------

    def qtensor(self, e: int, which: int) -> QTensor:
        """The quantized HF tensor (views of the stored bytes, scales and zero points)."""
        inter = self.intermediate
        if which == 2:
            values, scales, k, zeros = self.w2[e], self.w2_scale[e], inter, self.w2_zero
            zeros = zeros[e] if zeros is not None else None
        else:
            rows = slice(which * inter, (which + 1) * inter)
            values, scales, k = self.w13[e, rows], self.w13_scale[e, rows], self.hidden
            zeros = self.w13_zero[e, rows] if self.w13_zero is not None else None
        return QTensor("int4", values, scales, (1, INT4_GROUP), (values.shape[0], k), zeros=zeros)

    def put(self, e: int, which: int, q: QTensor) -> None:
        """Write one HF tensor: a checkpoint's (with zero points or not) or an update's, which
        the symmetric quantizer made, so its zero points become 0 (the dense store's rule)."""
        if q.zeros is not None and self.w13_zero is None:
            # The first tensor with zero points (a checkpoint served as stored, at load): every
            # other tensor's zero points are 0 until its own arrive, which means symmetric.
            self.w13_zero = torch.zeros(self.w13_scale.shape, dtype=torch.int8, device=self.w13.device)
            self.w2_zero = torch.zeros(self.w2_scale.shape, dtype=torch.int8, device=self.w2.device)
        dst = self.qtensor(e, which)
        dst.values.copy_(q.values)
        dst.scales.copy_(q.scales)
        if dst.zeros is not None:
            if q.zeros is not None:
                dst.zeros.copy_(q.zeros)
            else:
                dst.zeros.zero_()


class Int4Experts(Fp8Experts):
    """The model's INT4 experts, found from a weight view (uint8 rows of a packed stack)."""

    stored_dtype = torch.uint8
    fmt = "int4"

    def hf_shape(self, view: torch.Tensor) -> tuple[int, ...]:
        """The sent shape of the tensor(s) `view` holds: the packed last dim is half of it."""
        module, param = self.owner(view)  # type: ignore[misc]
        k = module.hidden if param == "w13" else module.intermediate  # type: ignore[attr-defined]
        return (*view.shape[:-1], k)


@torch.no_grad()
def convert_int4_experts(scope: nn.Module, quantized: Callable[[str], bool],
                         hf_prefix: Callable[[str], str],
                         stored: Mapping[str, QTensor] | None = None) -> list[Int4StackedExperts]:
    """The StackedExperts inside `scope` whose HF tensors `quantized(hf_name)` says are int4,
    packed in place (engine_experts.convert_fp8_experts' rules: a layer's experts all alike;
    `stored`: the checkpoint's QTensors, put in afterwards instead of packing the weights)."""
    modules = convert_fp8_experts(scope, quantized, hf_prefix, convert=_pack, fmt="int4", stored=stored)
    return modules  # type: ignore[return-value]


def _pack(module: StackedExperts, from_weights: bool = True) -> None:
    """In place: the stacked weights packed with their group scales (from_weights=False: the buffers
    only, for the checkpoint's own bytes to be put in)."""
    e, two_i, h = module.w13.shape
    inter = two_i // 2
    dev, dtype = module.w13.device, module.w13.dtype
    w13 = torch.empty(e, two_i, -(-h // 2), dtype=torch.uint8, device=dev)
    s13 = torch.empty(e, two_i, -(-h // INT4_GROUP), dtype=torch.float32, device=dev)
    w2 = torch.empty(e, h, -(-inter // 2), dtype=torch.uint8, device=dev)
    s2 = torch.empty(e, h, -(-inter // INT4_GROUP), dtype=torch.float32, device=dev)
    parts = ((module.w13.detach(), w13, s13), (module.w2.detach(), w2, s2))
    for src, dst, scale in parts if from_weights else ():
        # A chunk of experts per call (groups never leave a row: the same bits as one by one),
        # bounding the quantizer's float32 temporaries beside a layerwise start.
        step = _experts_per_chunk(src[0].numel())
        for first in range(0, e, step):
            chunk = src[first:first + step]
            q = quantize(chunk, "int4", "weight")
            dst[first:first + chunk.shape[0]].copy_(q.values)
            scale[first:first + chunk.shape[0]].copy_(q.scales.reshape(chunk.shape[0], chunk.shape[1], -1))
    module.__class__ = Int4StackedExperts
    module.w13 = nn.Parameter(w13, requires_grad=False)
    module.w2 = nn.Parameter(w2, requires_grad=False)
    module.register_buffer("w13_scale", s13)
    module.register_buffer("w2_scale", s2)
    module.register_buffer("w13_zero", None)  # zero points: allocated by `put` when some arrive
    module.register_buffer("w2_zero", None)
    module.compute_dtype = dtype
    module.hidden = h
    if dev.type == "cuda":  # probe the Triton kernels now, not inside a graph capture
        from milepost.kernels import fused_moe_int4
        from milepost.kernels.int4_gemm import kernel_ok

        kernel_ok(dev)
        fused_moe_int4.kernel_ok(dev)


# -- the trainer --------------------------------------------------------------------------------


def _fake_quant(w: torch.Tensor) -> torch.Tensor:
    """The INT4 values in w's dtype (a few experts per quantizer call, bounding its float32
    temporaries: the same bits, groups never leave a row), the gradient straight through to `w`."""
    with torch.no_grad():
        step = _experts_per_chunk(w[0].numel())
        q = torch.cat([qdq(w[i:i + step], "int4", "weight") for i in range(0, w.shape[0], step)])
    return w + (q - w).detach()


class Int4QatExperts(StackedExperts):
    """The trainer's experts under INT4 QAT (class swapped in by `apply_train_experts`): every
    forward path (CPU loop, grouped GEMMs) runs on the fake-quant weights."""

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _fake_quant(self.w13), _fake_quant(self.w2)


def apply_train_experts(model: nn.Module, train_format: Callable[[str], str]) -> list[str]:
    """Make the trainer's StackedExperts whose HF tensors `train_format(hf_name)` says are int4
    fake-quant experts; the HF names covered. A layer's experts all alike (else refused naming
    the layer), and adapted (LoRA) experts refused: their merged weights would train in bf16
    while the engines serve INT4."""
    done: list[str] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, StackedExperts):
            continue
        prefix = "model." + name[name.find("layers."):] + "."
        names = [f"{prefix}{e}.{p}_proj.weight" for e in range(module.num_experts)
                 for p in ("gate", "up", "down")]
        formats = {train_format(n) for n in names}
        if formats <= {"bf16"}:
            continue
        if formats != {"int4"}:
            mix = " and some ".join(sorted(formats))
            raise ValueError(f"{prefix}*: some of this layer's expert tensors are {mix} in training; "
                             "override all experts of one layer alike "
                             "('layers.A-B=bf16' or '*.experts.*=bf16')")
        if type(module) is not StackedExperts:
            raise ValueError(f"{prefix}*: {type(module).__name__} (LoRA on experts) under --precision int4 "
                             "would train the experts in bf16 while the engines serve INT4; keep "
                             "them in bf16 (--precision-override '*.experts.*=bf16') or drop the "
                             "expert targets from --lora-target-modules")
        module.__class__ = Int4QatExperts
        done += names
    return done
