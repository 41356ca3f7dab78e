"""Quantized linears for the trainer, and the helpers the engine's forward shares with it.

The trainer's covered linears run `LowPrecLinearFn`: the forward multiplies the quantized input
(per token: 1x128 FP8, 1x32 MX, 1x16 NVFP4 blocks) by the quantized weight; the backward runs both
GEMMs on quantized operands too (data gradient: the output gradient quantized along the output
features; weight gradient: both operands quantized along the tokens), with the weight's gradient
passed straight through to the bf16/fp32 master weight. NVFP4's dequantized-backward option runs
the backward GEMMs in the model dtype on the forward's dequantized operands. Emulated (quantize,
dequantize, ordinary GEMM): the values are the format's; native kernels change speed, not values.
NVFP4's stochastic-rounding option rounds the output gradient's elements stochastically
(stochastic.py; unbiased), as the NVFP4 training recipe does; activations and weights stay
round-to-nearest-even.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from milepost.lowprec.contract import BF16, Contract
from milepost.lowprec.fp8_options import Fp8TrainOptions
from milepost.lowprec.quantize import (
    QTensor,
    check_shape,
    dequantize,
    finite_amax,
    quantize,
)


def qdq(x: torch.Tensor, fmt: str, role: str = "activation", *, four_over_six: bool = False,
        outer_amax: torch.Tensor | None = None) -> torch.Tensor:
    """`x` quantized in `fmt` and dequantized back to x's dtype (blocks along the last dim)."""
    q = quantize(x, fmt, role, four_over_six=four_over_six, outer_amax=outer_amax)  # type: ignore[arg-type]
    return dequantize(q).to(x.dtype)


def quantize_activation(x: torch.Tensor, fmt: str, four_over_six: bool = False) -> torch.Tensor:
    """The input of a quantized linear as its GEMM sees it (per-token scales)."""
    return qdq(x, fmt, "activation", four_over_six=four_over_six)


def quantize_weight_parts(srcs: Sequence[torch.Tensor], fmt: str, contract: Contract,
                          names: Sequence[str]) -> list[QTensor]:
    """Quantize tensors that one GEMM uses together; NVFP4 gives them one outer scale."""
    outer = None
    if fmt == "nvfp4" and len(srcs) > 1:
        outer = torch.stack([finite_amax(s) for s in srcs]).amax()
    return [quantize(s, fmt, "weight", four_over_six=contract.four_over_six, name=n,
                     outer_amax=outer) for s, n in zip(srcs, names)]


class LowPrecLinearFn(torch.autograd.Function):
    """y = Q(x) @ Q(w)^T with quantized backward GEMMs (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, wq: torch.Tensor, fmt: str,
                four_over_six: bool, dequantized_backward: bool,
                stochastic: bool = False) -> torch.Tensor:
        xq = quantize_activation(x, fmt, four_over_six)
        ctx.save_for_backward(x, xq, wq)
        ctx.fmt, ctx.four, ctx.deq_bwd, ctx.sr = fmt, four_over_six, dequantized_backward, stochastic
        return F.linear(xq, wq)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):  # type: ignore[override]
        x, xq, wq = ctx.saved_tensors
        gy2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
        if ctx.deq_bwd:
            gx, gw = gy2 @ wq, gy2.t() @ xq.reshape(-1, x.shape[-1])
        else:
            four, fmt = ctx.four, ctx.fmt
            # dgrad contracts over out features: gy in blocks along them; wq is reused (the
            # 128x128 FP8 tiles are the same blocks transposed; MX/NVFP4 re-quantize along N).
            w_t = wq if fmt == "fp8_block" else qdq(wq.t().contiguous(), fmt, "weight",
                                                    four_over_six=four).t()
            grad_q = _stochastic if ctx.sr else qdq  # the gradient's elements: SR or nearest
            gx = grad_q(gy2, fmt, four_over_six=four) @ w_t
            pad = (-gy2.shape[0]) % _token_block(fmt)  # wgrad contracts over tokens
            gy_t = F.pad(gy2.t(), (0, pad)).contiguous()
            x_t = F.pad(x2.t(), (0, pad)).contiguous()
            gw = grad_q(gy_t, fmt, four_over_six=four) @ qdq(x_t, fmt, four_over_six=four).t()
        return gx.reshape(x.shape), gw.to(wq.dtype), None, None, None, None, None


def _stochastic(x: torch.Tensor, fmt: str, four_over_six: bool = False) -> torch.Tensor:
    from milepost.lowprec.stochastic import qdq_nvfp4_stochastic

    return qdq_nvfp4_stochastic(x, four_over_six)


def _native_fp8(m: LowPrecLinear, x: torch.Tensor) -> bool:
    """FP8 blockwise on a Hopper GPU with whole tiles: the native GEMMs (same values)."""
    if m.qformat != "fp8_block" or not x.is_cuda or x.dtype == torch.float32:
        return False
    n, k = m.weight.shape
    if n % 128 or k % 128 or torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    from milepost.kernels.fp8_gemm import block_backend

    return block_backend(x.device) != "emulated"


def native_weight(m: nn.Linear, transposed: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(float8 values [N, K], float32 128 x 128 tile scales, values transposed [K, N] or None) of
    a native FP8 linear's weight: the shared quantizer's bits, by the torch quantizer or (option
    weight_quant "triton") in one Triton pass that also writes the transposed values."""
    opts = getattr(m, "fp8_options", Fp8TrainOptions())
    with torch.no_grad():
        if opts.weight_quant == "triton":
            from milepost.kernels.fp8_train_quant import quantize_weight_tiles

            return quantize_weight_tiles(m.weight, transposed)
        q = quantize(m.weight, "fp8_block", "weight")
    return q.values, q.scales, None


def fp8_options_arg(m: nn.Module) -> Fp8TrainOptions | None:
    """What the native FP8 autograd functions get: None for the defaults, so that the usual call
    passes only tensors (torch.compile around a layer, --compile-layers, traces it as before)."""
    opts = getattr(m, "fp8_options", Fp8TrainOptions())
    return None if opts == Fp8TrainOptions() else opts


def set_fp8_options(model: nn.Module, opts: Fp8TrainOptions) -> int:
    """Give every FP8 blockwise LowPrecLinear of `model` these native quantize passes; returns
    how many (benchmarks/fp8_train_profile.py A/Bs them; the values do not change)."""
    linears = [m for m in model.modules() if isinstance(m, LowPrecLinear) and m.qformat == "fp8_block"]
    for m in linears:
        m.fp8_options = opts
    return len(linears)


def _token_block(fmt: str) -> int:
    return {"fp8_block": 1, "mxfp8": 32, "nvfp4": 16}[fmt]


class LowPrecLinear(nn.Linear):
    """A trainer linear in a low-precision format (class swapped in by apply_train_precision)."""

    qformat: str
    four_over_six: bool
    dequantized_backward: bool
    stochastic_rounding: bool = False
    fp8_options: Fp8TrainOptions = Fp8TrainOptions()  # native FP8 quantize passes (same values)

    def quantized_weight(self) -> torch.Tensor:
        """This weight's values as the engine holds them (dequantized, model dtype)."""
        partner = self.__dict__.get("_joint_with")  # nvfp4: gate and up share the outer scale
        outer = None
        if partner is not None:
            outer = torch.maximum(finite_amax(self.weight), finite_amax(partner.weight))
        with torch.no_grad():
            return qdq(self.weight, self.qformat, "weight", four_over_six=self.four_over_six,
                       outer_amax=outer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qformat == "int4":  # QAT: fake-quant weight, straight-through, GEMMs in dtype
            w = self.weight + (self.quantized_weight() - self.weight).detach()
            return F.linear(x, w, self.bias)
        if "_delayed" in self.__dict__:  # --fp8-scaling delayed: per-tensor scales from history
            from milepost.lowprec.delayed import delayed_forward

            return delayed_forward(self, x)
        if _native_fp8(self, x):
            from milepost.kernels.fp8_gemm_train import Fp8BlockLinearFn

            wv, ws, wvt = native_weight(self)
            y = Fp8BlockLinearFn.apply(x, self.weight, wv, ws, fp8_options_arg(self), wvt)
            return y + self.bias if self.bias is not None else y
        # The weight's gradient goes straight through to the master weight (wq carries none).
        y = LowPrecLinearFn.apply(x, self.weight, self.quantized_weight(), self.qformat,
                                  self.four_over_six, self.dequantized_backward,
                                  self.stochastic_rounding)
        return y + self.bias if self.bias is not None else y


def apply_train_precision(model: nn.Module, contract: Contract, *,
                          dequantized_backward: bool = False,
                          stochastic_rounding: bool = False) -> list[str]:
    """Swap the trainer model's covered linears (by HF name, overrides applied) for LowPrecLinear,
    and its MoE experts for fake-quant ones where the contract trains them quantized (INT4:
    lowprec/experts_int4.py); returns the names of the quantized weights. A shape the format
    cannot hold is refused here, at start, naming the tensor."""
    from milepost.lowprec.experts_int4 import apply_train_experts  # it imports this module

    done: list[str] = apply_train_experts(model, lambda hf: contract.tensor_format(hf, "train"))
    by_name: dict[str, LowPrecLinear] = {}
    for name, module in model.named_modules():
        hf = _hf_name(name) + ".weight"
        fmt = contract.tensor_format(hf, "train")
        if fmt == BF16 or type(module) is not nn.Linear:
            continue
        check_shape(fmt, tuple(module.weight.shape), hf)
        module.__class__ = LowPrecLinear
        module.qformat, module.four_over_six = fmt, contract.four_over_six
        module.dequantized_backward = dequantized_backward
        module.stochastic_rounding = stochastic_rounding and fmt == "nvfp4"
        by_name[name] = module  # type: ignore[assignment]
        done.append(hf)
    for name, module in by_name.items():
        if module.qformat == "nvfp4" and name.endswith("gate_proj"):
            up = by_name.get(name.removesuffix("gate_proj") + "up_proj")
            if up is not None:  # plain attributes: not registered as submodules
                module.__dict__["_joint_with"], up.__dict__["_joint_with"] = up, module
    return done


def _hf_name(module_name: str) -> str:
    """Module path -> HF prefix (wrappers such as FSDP or TokenScorer add leading parts)."""
    i = module_name.find("layers.")
    return "model." + module_name[i:] if i >= 0 else module_name
