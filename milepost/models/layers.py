"""Building blocks shared by the native decoder models: RMSNorm, gated MLP, self-attention (RoPE: rope.py).

Linear layers are plain `nn.Linear` members under their Hugging Face names (q_proj, gate_proj, ...)
so quantized linears or LoRA can be swapped in per module later. Everything is out-of-place so the
trainer can backprop through the same code the engine runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from milepost.lowprec import fp8_act
from milepost.lowprec.fp8_act import Fp8Act, SplitSum, summed, takes_fp8_act, unsummed
from milepost.models.base import ForwardContext
from milepost.models.masked_attention import Variant, attend_variant
from milepost.models.meta import on_meta
from milepost.models.rope import (  # noqa: F401 - RoPE lived here first; importers still find it
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    apply_rotary,
    rope_inv_freq,
    rope_parameters,
)


def gpu_inference(x: torch.Tensor) -> bool:
    """Use the fused Triton kernels (milepost/kernels/fused_ops.py): CUDA under inference_mode,
    i.e. the engine. The trainer (autograd, or no_grad re-scoring) keeps the torch ops."""
    return x.is_cuda and torch.is_inference_mode_enabled()


def fused_training(module: nn.Module, x: torch.Tensor) -> bool:
    """Use the fused training kernels with backward (milepost/kernels/train_fused.py): the module
    was switched on by `set_fused_training` (the trainer, on CUDA) and x is CUDA bf16/fp16."""
    return module.fused_train and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def set_fused_training(model: nn.Module, on: bool) -> int:
    """Switch the fused training kernels (RMSNorm, RoPE, SiLU-and-mul, grouped MoE experts) of
    every native block of `model` on or off; returns how many modules were switched. Off by
    default: the engine and the CPU path run the torch ops."""
    switched = 0
    for m in model.modules():
        if hasattr(m, "fused_train"):  # RMSNorm, GatedMLP, SelfAttention, MoE StackedExperts
            m.fused_train = on
            switched += 1
    return switched


class RMSNorm(nn.Module):
    """Normalizes in fp32, casts back, then scales (the order transformers uses, for bf16 parity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused_train = False  # set_fused_training

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gpu_inference(x):
            from milepost.kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps)
        if fused_training(self, x) and self.weight.dtype == x.dtype:
            from milepost.kernels import train_fused

            return train_fused.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def norm_for(norm: nn.Module, x: torch.Tensor, consumer: nn.Module | None) -> torch.Tensor | Fp8Act:
    """norm(x); on the GPU inference path, for a `consumer` linear that takes FP8 activations
    (lowprec/fp8_act.py), quantized inside the norm's kernel instead: one launch, not two."""
    if type(norm) is RMSNorm and x.dim() == 2 and takes_fp8_act(consumer) and gpu_inference(x):
        from milepost.kernels.fused_fp8_act import rms_norm_fp8

        return rms_norm_fp8(x, norm.weight, norm.eps)
    return norm(x)


def add_norm_for(x: torch.Tensor, r: torch.Tensor | SplitSum, norm: RMSNorm, consumer: nn.Module | None
                 ) -> tuple[torch.Tensor, torch.Tensor | Fp8Act]:
    """GPU inference: fused_ops.add_rms_norm(x, r, ...) = (x + r, norm(x + r)), the normed rows
    quantized inside the same kernel for a `consumer` that takes FP8 activations."""
    if takes_fp8_act(consumer):
        from milepost.kernels.fused_fp8_act import add_rms_norm_fp8

        return add_rms_norm_fp8(x, r, norm.weight, norm.eps)  # sums a SplitSum r itself
    from milepost.kernels.fused_ops import add_rms_norm

    return add_rms_norm(x, summed(r), norm.weight, norm.eps)


def project_out(linear: nn.Module, x: torch.Tensor | Fp8Act, ctx: ForwardContext | None
                ) -> torch.Tensor | SplitSum:
    """linear(x); where the output goes straight into a fused add + norm (ctx.unsummed_outputs)
    and fp8_act.PARTS_TO_NORM, possibly a split FP8 GEMM's unsummed parts for that kernel to
    sum (fp8_act.unsummed)."""
    if ctx is not None and ctx.unsummed_outputs and fp8_act.PARTS_TO_NORM:
        return unsummed(linear, x)
    return linear(x)


def check_silu(config: object) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported by the native models (only 'silu')")


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear computing the parts' outputs side by side (their weight rows stacked): one GEMM
    that reads the input once instead of one per part. Copies the weights; parts share in/bias."""
    bias = parts[0].bias is not None
    weight = torch.cat([p.weight.detach() for p in parts])
    with on_meta():  # no throwaway allocation: the parameters are replaced below
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    grad = parts[0].weight.requires_grad
    fused.weight = nn.Parameter(weight, requires_grad=grad)
    if bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=grad)
    return fused


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)).

    gate and up are separate HF-named modules; the engine fuses them into one `gate_up_proj`
    (DecoderLM.fuse_projections) so a step runs one GEMM for both.
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up_proj: nn.Linear | None = None
        self.fused_train = False  # set_fused_training

    def forward(self, x: torch.Tensor | Fp8Act, ctx: ForwardContext | None = None
                ) -> torch.Tensor | SplitSum:
        """x: [T, hidden], or an Fp8Act where gate_up_proj takes one (the norm made it); a
        SplitSum only where ctx.unsummed_outputs allows it."""
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # row-strided views, no copy
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if gpu_inference(gate):
            if gate.dim() == 2 and takes_fp8_act(self.down_proj):  # its input quantized here
                from milepost.kernels.fused_fp8_act import silu_mul_fp8

                return project_out(self.down_proj, silu_mul_fp8(gate, up), ctx)
            from milepost.kernels.fused_ops import silu_mul

            return self.down_proj(silu_mul(gate, up))
        if fused_training(self, gate):
            from milepost.kernels import train_fused

            return self.down_proj(train_fused.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class SelfAttention(nn.Module):
    """Projections, optional per-head q/k RMSNorm (Qwen3), RoPE, then the context's attention backend."""

    def __init__(
        self, config: object, layer_id: int, qk_norm: bool, qkv_bias: bool | None = None,
        window: int | None = None,
    ) -> None:
        """qkv_bias: bias on q/k/v only (Qwen2); None = config.attention_bias on all four.
        window: sliding window of this layer in tokens (None: full attention)."""
        super().__init__()
        self.layer_id = layer_id
        self.window = window
        self.softcap: float | None = None  # attention logit soft-cap (Gemma 2), set by the model
        self.sinks: nn.Parameter | None = None  # per-head sink logits [H] (gpt-oss), set by the model
        self.fused_norm_rope = True  # the GPU norm+RoPE kernel assumes Llama-style q/k norms
        self.fused_train = False  # set_fused_training
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        self.scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        in_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=in_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=in_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=in_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # The engine replaces q/k/v_proj by one qkv_proj (DecoderLM.fuse_projections).
        self.qkv_proj: nn.Linear | None = None
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self._qkv_sizes = [q_out, kv_out, kv_out]

    def forward(
        self, x: torch.Tensor | Fp8Act, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor | SplitSum:
        """x: [T, hidden] (or an Fp8Act where qkv_proj takes one: the norm made it) -> [T, hidden]
        (a SplitSum only where ctx.unsummed_outputs allows it)."""
        t = x.rows if isinstance(x, Fp8Act) else x.shape[0]
        on_gpu = gpu_inference(x.values if isinstance(x, Fp8Act) else x)
        plain = self.window is None and self.softcap is None and self.sinks is None
        if (self.qkv_proj is not None and plain and self.fused_norm_rope and on_gpu
                and getattr(ctx.attention, "can_attend_qkv", bool)()):
            # GPU engine: q/k norm + RoPE and the KV store in one kernel, then attention.
            qw, kw = (n.weight if n is not None else None for n in (self.q_norm, self.k_norm))
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            qkv = unsummed(self.qkv_proj, x)  # split FP8 parts: the RoPE + store kernel sums them
            out = ctx.attention.attend_qkv(self.layer_id, qkv, self.num_heads, self.num_kv_heads,
                                           qw, kw, eps, cos, sin, self.scale,
                                           fp8_out=takes_fp8_act(self.o_proj))
            if not isinstance(out, Fp8Act):  # else quantized for o_proj by the attention kernel
                out = out.reshape(t, self.num_heads * self.head_dim)
            return project_out(self.o_proj, out, ctx)
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self._qkv_sizes, dim=-1)  # row-strided views
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if on_gpu and self.fused_norm_rope:  # one fused kernel each for q and k, not ~17
            from milepost.kernels.fused_ops import norm_rope

            qw, kw = (n.weight if n is not None else None for n in (self.q_norm, self.k_norm))
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            q, k = norm_rope(q, qw, eps, cos, sin), norm_rope(k, kw, eps, cos, sin)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            rotate = apply_rotary
            # the kernel takes power-of-two half head dims (every model we train: 64)
            if fused_training(self, q) and cos.dtype == q.dtype and not (self.head_dim // 2) & (self.head_dim // 2 - 1):
                from milepost.kernels import train_fused

                rotate = train_fused.apply_rotary
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if plain:
            out = ctx.attention.attend(self.layer_id, q, k, v, self.scale)  # [T, H, D]
        else:  # windowed / soft-capped / sink layers: torch reference path over the same backend
            var = Variant(window=self.window, softcap=self.softcap, sinks=self.sinks)
            out = attend_variant(ctx.attention, self.layer_id, q, k, v, self.scale, var)
        return project_out(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), ctx)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

    # GPU inference: the residual add and the norm after attention in one kernel (same values);
    # a class switch only so benchmarks/engine_mixed_profile.py can measure both.
    fuse_residual_norm = True

    def __init__(
        self, config: object, layer_id: int, qk_norm: bool, mlp: nn.Module, qkv_bias: bool | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layer_id, qk_norm, qkv_bias, window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def attn_input(self) -> nn.Module | None:
        """The linear that alone reads the input norm's output (None: several do)."""
        return self.self_attn.qkv_proj if type(self.self_attn) is SelfAttention else None

    def mlp_input(self) -> nn.Module | None:
        """The linear that alone reads the post-attention norm's output (None: not a GatedMLP,
        or gate and up apart)."""
        return self.mlp.gate_up_proj if type(self.mlp) is GatedMLP else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        attn = self.self_attn(norm_for(self.input_layernorm, x, self.attn_input()), cos, sin, ctx)
        norm = self.post_attention_layernorm
        if self.fuse_residual_norm and gpu_inference(x) and type(norm) is RMSNorm and x.dim() == 2:
            h, normed = add_norm_for(x, attn, norm, self.mlp_input())  # same values, one launch
            return h + self.mlp(normed, ctx)
        h = x + attn
        return h + self.mlp(norm_for(norm, h, self.mlp_input()), ctx)

    def forward_parts(
        self, x: torch.Tensor, normed_x: torch.Tensor | Fp8Act, cos: torch.Tensor, sin: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor | SplitSum]:
        """GPU inference with x's input norm already computed (fused_residuals; an Fp8Act where
        attn_input takes one): (h, mlp_out), the layer's output being h + mlp_out, an add the
        caller fuses into the next norm."""
        attn = self.self_attn(normed_x, cos, sin, ctx)
        h, normed = add_norm_for(x, attn, self.post_attention_layernorm, self.mlp_input())
        return h, self.mlp(normed, ctx)


def fused_residuals(layers: nn.ModuleList, final_norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether a model's residual adds can run inside its RMSNorm kernels (GPU inference, plain
    DecoderLayers with RMSNorms throughout): DecoderLM.forward then fuses each layer's last add
    with the next layer's input norm (and the final norm)."""
    return (DecoderLayer.fuse_residual_norm and gpu_inference(x) and x.dim() == 2
            and type(final_norm) is RMSNorm
            and all(type(layer) is DecoderLayer and type(layer.input_layernorm) is RMSNorm
                    and type(layer.post_attention_layernorm) is RMSNorm for layer in layers))
