"""`compile_layers`: torch.compile each decoder layer's forward for training (opt-in, dense models).

The layer's elementwise work (RMSNorm in fp32, q/k norms, RoPE, SiLU * up, residual adds) is
many small kernels and much host dispatch per layer; compiled, each run of them becomes a few
fused kernels. Attention stays eager (`VarlenCausalAttention.attend` is excluded from tracing),
so every layer splits into two graphs around it. Shapes are dynamic (micro-batches differ in
tokens), and integer module attributes (layer ids) are not specialized, so all layers share the
same compiled graphs instead of recompiling per layer. Parameter names do not change (the
module itself is not wrapped), so FSDP2, checkpoints and Hugging Face export see the same model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _scoped(compiled: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        # Read when dynamo compiles (on a call); scoped here, not a process-wide setting.
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return compiled(*args, **kwargs)

    return call


@functools.cache  # once per process
def _keep_attention_eager() -> None:
    """Exclude `VarlenCausalAttention.attend` from tracing. Done here rather than as a decorator:
    `torch.compiler.disable` imports dynamo (~1.5 s), which every engine and trainer process
    would pay at import without ever compiling."""
    from milepost.models.attention import VarlenCausalAttention

    VarlenCausalAttention.attend = torch.compiler.disable(VarlenCausalAttention.attend)  # type: ignore[method-assign]


def compile_decoder_layers(layers: nn.ModuleList, backend: str = "inductor") -> None:
    """Replace each layer's `forward` by a compiled one (call before `fully_shard`)."""
    _keep_attention_eager()
    for layer in layers:
        layer.forward = _scoped(torch.compile(layer.forward, dynamic=True, backend=backend))
