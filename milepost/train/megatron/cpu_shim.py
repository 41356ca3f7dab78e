"""Let megatron-core 0.16 run its models on a CPU-only torch build (tests, the CPU demo).

megatron-core assumes CUDA in a few places that our CPU path reaches: `torch.cuda.current_device()`
as an allocation device (rotary inv_freq, parallel layers), the CUDA RNG tracker used around
attention, and `te_general_gemm` referenced in the MoE router without Transformer Engine. The
patches below are installed only on a CPU-only build, once per process, and change no number:
our models have no dropout, so the RNG fork is a no-op. Pipeline parallel: the schedules allocate a
token counter on device="cuda", p2p communication calls `torch.cuda.synchronize()` and a tied
embedding is copied with `.cuda()` on the last stage: with those mapped to the CPU (below),
`get_forward_backward_func()` with PP = 2 runs on gloo (the backend's pipeline.py). The
distributed optimizer (dist_optim.py) allocates two scalars on device="cuda" and checks that its
parameters are `torch.cuda.*Tensor`s while it is built: `install_cpu_optimizer_shim` and
`cpu_tensors_named_as_cuda`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

_INSTALLED = False


class _NoDropoutRngTracker:
    """Stands in for megatron's CudaRNGStatesTracker when nothing random runs inside its forks."""

    def fork(self, name: str | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def is_initialized(self) -> bool:
        return True

    def get_states(self) -> dict[str, torch.Tensor]:
        return {}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        pass


class _CpuTorch(types.ModuleType):
    """`torch` as megatron's schedules.py sees it: its device="cuda" allocations land on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def tensors_stay_on_cpu() -> Iterator[None]:
    """`Tensor.cuda()` returns the tensor itself while building a model on a CPU-only build (the
    tied embedding's copy on the last pipeline stage); restored after."""
    if torch.cuda.is_available():
        yield
        return
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda  # type: ignore[method-assign]


def install_cpu_shim() -> bool:
    """Install the CPU patches when CUDA is absent; returns whether they are (now) installed.

    The `te_general_gemm` default is set on every device (megatron-core 0.16 reads the name
    whether or not Transformer Engine imported)."""
    global _INSTALLED
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # on CUDA too: the router tests it for None
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.pipeline_parallel import schedules

    # Megatron passes this as `device=` for new tensors; "cpu" is what a CPU build can allocate on.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = _NoDropoutRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    schedules.torch = _CpuTorch("torch")  # total_num_tokens = torch.zeros(..., device="cuda")
    torch.cuda.synchronize = lambda *args, **kwargs: None  # p2p after batched send/recv; nothing to wait for
    _INSTALLED = True
    return True


def install_cpu_optimizer_shim() -> None:
    """On a CPU-only build, megatron's optimizer module allocates on the CPU where it names "cuda"
    (MixedPrecisionOptimizer's `_dummy_overflow_buf` and `_scale_one`, unused by our fp32 step)."""
    if torch.cuda.is_available():
        return
    from megatron.core.optimizer import optimizer

    if not isinstance(optimizer.torch, _CpuTorch):
        optimizer.torch = _CpuTorch("torch")


@contextlib.contextmanager
def cpu_tensors_named_as_cuda() -> Iterator[None]:
    """`Tensor.type()` names a CPU tensor as its CUDA type (torch.cuda.FloatTensor), on a CPU-only
    build only, while megatron's DistributedOptimizer is built: it sorts parameters into fp32 and
    16-bit groups by that name and refuses any other. Restored after."""
    if torch.cuda.is_available():
        yield
        return
    type_of = torch.Tensor.type

    def cuda_named(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:  # a conversion, not a query
            return type_of(self, *args, **kwargs)
        name = type_of(self)
        return name if self.is_cuda else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = type_of  # type: ignore[method-assign]


def block_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """A [1, 1, s, s] boolean mask (True = masked) of packed sequences, each causal on its own.

    Passed explicitly on every forward: megatron's default causal mask is allocated on
    device="cuda", and a packed micro-batch needs the block structure anyway.
    """
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    total = int(seq.numel())
    causal = torch.ones(total, total, dtype=torch.bool, device=device).triu(1)
    return (causal | (seq[:, None] != seq[None, :]))[None, None]
