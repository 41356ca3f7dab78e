"""Let megatron-core 0.16 run its models on a CPU-only torch build (tests, the CPU demo).

megatron-core assumes CUDA in a few places that our CPU path reaches: `torch.cuda.current_device()`
as an allocation device (rotary inv_freq, parallel layers), the CUDA RNG tracker used around
attention, and `te_general_gemm` referenced in the MoE router without Transformer Engine. The
patches below are installed only on a CPU-only build, once per process, and change no number:
our models have no dropout, so the RNG fork is a no-op. Pipeline parallelism still needs CUDA
(its schedules allocate on device="cuda"): `validate_sizes` refuses PP > 1 on CPU.
"""

from __future__ import annotations

import contextlib

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

    # Megatron passes this as `device=` for new tensors; "cpu" is what a CPU build can allocate on.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = _NoDropoutRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _INSTALLED = True
    return True


def block_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """A [1, 1, s, s] boolean mask (True = masked) of packed sequences, each causal on its own.

    Passed explicitly on every forward: megatron's default causal mask is allocated on
    device="cuda", and a packed micro-batch needs the block structure anyway.
    """
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    total = int(seq.numel())
    causal = torch.ones(total, total, dtype=torch.bool, device=device).triu(1)
    return (causal | (seq[:, None] != seq[None, :]))[None, None]
