"""Tiny INT4 checkpoints with zero points written by hand from the layout's definition (no
compressed-tensors package, no milepost quantizer): compressed-tensors pack-quantized with
`symmetric: false`. AWQ and asymmetric GPTQ writers are in quant_checkpoints.py; together they
cover every zero-point layout the engines serve as stored, dense projections and MoE experts
alike (a Qwen3-MoE checkpoint's `mlp.experts.N.*_proj` are covered projections)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from milepost.testing.quant_checkpoints import _config, compressed_config, covered, pack_int4_words


def write_int4_asym(src: Path, dst: Path, group: int, seed: int = 9) -> dict[str, torch.Tensor]:
    """A compressed-tensors W4A16 checkpoint with zero points (pack-quantized, `symmetric: false`,
    `group` values per scale along a row; 0: `strategy: channel`). Each covered weight gets
    random values v in -8..7 (`X.weight_packed`: eight a word along the row, stored + 8), random
    bf16 scales [out, groups] (`X.weight_scale`), `X.weight_shape`, and random zero points z in
    -8..7 per row and group, stored as compressed-tensors packs them: + 8, eight rows of a group
    column per int32 word (`X.weight_zero_point` [ceil(out/8), groups], row 8j+i in bits
    4i..4i+3 of word j). The weight is (v - z) * scale. Returns the tensors written plus each
    weight's ints (v - z) under `X.values` (not in the file) for `quant_checkpoints.meaning`."""
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    for n, t in load_file(src / "model.safetensors").items():
        if not covered(n):
            out[n] = t
            continue
        rows, cols = t.shape
        base = n.removesuffix(".weight")
        width = group or cols
        groups = -(-cols // width)
        v = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
        z = torch.randint(-8, 8, (rows, groups), generator=g, dtype=torch.int8)
        out[base + ".weight_packed"] = pack_int4_words(v)
        out[base + ".weight_scale"] = (torch.rand(rows, groups, generator=g) * 1e-2 + 1e-4).bfloat16()
        out[base + ".weight_shape"] = torch.tensor([rows, cols])
        # Down the output dim: pack the transpose along its rows, then transpose back.
        out[base + ".weight_zero_point"] = pack_int4_words(z.t().contiguous()).t().contiguous()
        kept[base + ".values"] = v.to(torch.int16) - z.to(torch.int16).repeat_interleave(width, 1)[:, :cols]
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    _config(src, dst, compressed_config(
        {"num_bits": 4, "type": "int", "symmetric": False, "dynamic": False, **strategy}, None,
        "pack-quantized", ["lm_head"]))
    return {**out, **kept}
