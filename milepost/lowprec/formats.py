"""The low-precision formats' names and block shapes, without torch.

The run config's refusals and the launcher read these (milepost/lowprec/contract.py, rules.py);
kept apart from the quantizer (quantize.py) so that a process that only checks a config and
starts others does not import torch (~1.5 s of CPU at every `milepost train` start).
"""

from __future__ import annotations

from typing import Literal

Format = Literal["fp8_block", "mxfp8", "nvfp4", "int4"]
Role = Literal["weight", "activation"]
FORMATS: tuple[str, ...] = ("fp8_block", "mxfp8", "nvfp4", "int4")
FP8_TILE = 128
MX_BLOCK = 32
NVFP4_BLOCK = 16
INT4_GROUP = 128  # INT4 (QAT): symmetric, one float32 scale per 128 weights of a row, values -8..7


def block_shape(fmt: str, role: Role) -> tuple[int, int]:
    if fmt == "fp8_block":
        return (FP8_TILE, FP8_TILE) if role == "weight" else (1, FP8_TILE)
    if fmt in ("mxfp8", "nvfp4"):
        return (1, MX_BLOCK if fmt == "mxfp8" else NVFP4_BLOCK)
    if fmt == "int4":
        return (1, INT4_GROUP)
    raise ValueError(f"unknown low-precision format {fmt!r}; one of {', '.join(FORMATS)}")
