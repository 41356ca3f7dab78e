"""The trainer's side of the precision contract: its covered linears become quantized linears
(milepost/lowprec/linear.py) before sharding. The engines' flags: rules.py (`engine_precision_flags`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from milepost.lowprec.contract import Contract, native_support
from milepost.lowprec.delayed import DelayedScaling, DelayedSettings, attach_delayed
from milepost.lowprec.linear import apply_train_precision

if TYPE_CHECKING:
    from milepost.train.settings import TrainerSettings

log = logging.getLogger(__name__)


def quantize_trainer(model: nn.Module, s: TrainerSettings, device: torch.device) -> list[str]:
    contract = Contract(s.precision, s.precision, s.precision_overrides, s.nvfp4_four_over_six)
    names = apply_train_precision(model, contract, dequantized_backward=s.nvfp4_dequantized_backward,
                                  stochastic_rounding=s.nvfp4_stochastic_rounding)
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if s.precision == "fp8_block" and cap is not None and cap >= (9, 0) and s.dtype != "float32":
        # linear.py's _native_fp8: FP8 GEMMs where a linear's dims are whole 128 x 128 tiles and
        # the GEMM probe passed; the values are the emulated path's either way.
        log.info("trainer precision fp8_block: %d linears quantized; native FP8 GEMMs on %s where "
                 "both dims are multiples of 128 (else emulated: quantize, dequantize, GEMM in %s)",
                 len(names), torch.cuda.get_device_name(device), s.dtype)
    else:
        log.warning("trainer precision %s: %d linears quantized; GEMMs emulated (quantize, "
                    "dequantize, GEMM in %s)%s", s.precision, len(names), s.dtype,
                    "" if native_support(s.precision, cap) else
                    f"; {'the CPU' if cap is None else f'compute capability {cap}'} has no native "
                    f"{s.precision} GEMM")
    return names


def delayed_scaling_for(s: TrainerSettings, policy: nn.Module, readers: list[nn.Module],
                        device: torch.device) -> DelayedScaling | None:
    """The policy's amax history under `--fp8-scaling delayed` (None under current scaling); the
    reference model (`readers`) reads its scales. Its linears run the emulated GEMMs: the native
    Hopper path quantizes activations per 1 x 128 block itself."""
    if s.fp8_scaling != "delayed":
        return None
    return attach_delayed(policy, DelayedSettings(s.fp8_amax_history_len,
                                                  s.fp8_amax_compute_algo,  # type: ignore[arg-type]
                                                  s.fp8_margin), device, readers)
