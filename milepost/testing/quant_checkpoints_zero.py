"""Tiny INT4 checkpoints with zero points written by hand from the layout's definition (no
compressed-tensors package, no milepost quantizer): compressed-tensors pack-quantized with
`symmetric: false`. AWQ and asymmetric GPTQ writers are in quant_checkpoints.py; together they
cover every zero-point layout the engines serve as stored, dense projections and MoE experts
alike (a Qwen3-MoE checkpoint's `mlp.experts.N.*_proj` are covered projections)."""

from __future__ import annotations

from pathlib import Path

import torch

from milepost.testing.quant_checkpoints import write_int4


def write_int4_asym(src: Path, dst: Path, group: int, seed: int = 9) -> dict[str, torch.Tensor]:
    """A compressed-tensors W4A16 checkpoint with zero points (pack-quantized, `symmetric: false`,
    `group` values per scale along a row; 0: `strategy: channel`): `write_int4` with `sym=False`,
    whose docstring gives the layout. The weight is (v - z) * scale; each weight's ints (v - z)
    are under `X.values` (not in the file) for `quant_checkpoints.meaning`."""
    return write_int4(src, dst, group, seed, sym=False)
