"""Reading FP8 blockwise checkpoints: DeepSeek-V3/R1, Qwen3-*-FP8, and `milepost.lowprec.convert`'s.

The layout (config.json `quantization_config`: `quant_method: fp8`, `fmt: e4m3`,
`weight_block_size: [128, 128]`, `activation_scheme: dynamic|static`, optional
`modules_to_not_convert` / `ignored_layers`): each quantized linear has `X.weight` in
float8_e4m3fn and `X.weight_scale_inv` float32 [ceil(out/128), ceil(in/128)]; the dequantized
weight is `weight * weight_scale_inv` per 128 x 128 tile (the "inv" is the inverse of the
quantization scale: a multiplier). That is exactly the shared quantizer's QTensor for fp8_block
(its `scales` multiply too: `amax / 448`), so a checkpoint tensor becomes a QTensor with no
arithmetic, and its dequantization is `quantize.dequantize`, the function every stage uses.
Tensors the checkpoint kept unquantized are stored in the model dtype and stay there. A layout
the engines cannot hold exactly (another block size, per-tensor scales, E5M2, another quant
method) is refused at start naming the setting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from milepost.lowprec.formats import FP8_TILE

if TYPE_CHECKING:  # detection (fp8_checkpoint, unquantized_weights) runs in the config check, without torch
    import torch

    from milepost.lowprec.quantize import QTensor

SCALE_INV_SUFFIX = ".weight_scale_inv"


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What a checkpoint's `quantization_config` says, checked."""

    activation_scheme: str  # "dynamic" | "static" (then `X.input_scale`, float32, per linear)
    not_converted: tuple[str, ...]  # module names the checkpoint kept unquantized (informative)


def fp8_checkpoint(path: str | Path) -> Fp8Checkpoint | None:
    """The FP8 blockwise layout of the checkpoint at `path`, None for an unquantized one; a
    quantized layout the engines cannot hold exactly raises ValueError naming the setting."""
    cfg_file = Path(path) / "config.json"
    try:
        qc = json.loads(cfg_file.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None  # no readable config: the loader reports that itself
    if not qc:
        return None
    where = f"{cfg_file}: quantization_config"
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"{where}.quant_method is {method!r}; milepost loads FP8 blockwise "
                         "checkpoints (quant_method fp8) and unquantized ones: use the bf16 "
                         "checkpoint of this model (quantize it on load with --quantization)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt is {fmt!r}; the engines hold FP8 as E4M3 (float8_e4m3fn) "
                         "only: use an e4m3 checkpoint or the bf16 one")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError(f"{where} has no weight_block_size: per-tensor (or per-channel) FP8 "
                         f"scales; the engines serve {FP8_TILE} x {FP8_TILE} blockwise scales: "
                         "use a blockwise FP8 checkpoint, or the bf16 one with --quantization "
                         "fp8_block (or `python -m milepost.lowprec.convert` from it)")
    if list(block) != [FP8_TILE, FP8_TILE]:
        raise ValueError(f"{where}.weight_block_size is {list(block)}; the engines' FP8 tiles are "
                         f"[{FP8_TILE}, {FP8_TILE}] (DeepSeek-V3's): re-quantize the bf16 "
                         "checkpoint with `python -m milepost.lowprec.convert`")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{where}.activation_scheme is {scheme!r}; expected dynamic or static")
    skipped = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Checkpoint(scheme, tuple(skipped))


def checkpoint_qtensor(name: str, weight: torch.Tensor, scale_inv: torch.Tensor | None) -> QTensor:
    """The QTensor of checkpoint tensor `name` (float8_e4m3fn) from its `weight_scale_inv`, as
    stored (scales multiply, as the quantizer's do); a missing or misshapen scale is refused."""
    from milepost.lowprec.quantize import QTensor

    if weight.dim() != 2:
        raise ValueError(f"{name}: an FP8 weight of shape {list(weight.shape)}; the engines load "
                         "2-d FP8 linears (per-expert names for MoE experts), not stacked ones")
    if scale_inv is None:
        raise ValueError(f"{name} is float8_e4m3fn but the checkpoint has no "
                         f"{name.removesuffix('.weight')}{SCALE_INV_SUFFIX}")
    rows, cols = weight.shape
    want = (-(-rows // FP8_TILE), -(-cols // FP8_TILE))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name.removesuffix('.weight')}{SCALE_INV_SUFFIX} has shape "
                         f"{list(scale_inv.shape)}; {FP8_TILE} x {FP8_TILE} tiles of a "
                         f"{list(weight.shape)} weight need {list(want)}")
    # float32 as stored (bf16 scales widen exactly): the multiplier every stage dequantizes with.
    return QTensor("fp8_block", weight, scale_inv.float(), (FP8_TILE, FP8_TILE), tuple(weight.shape))


def unquantized_weights(path: str | Path) -> list[str]:
    """The `*.weight` tensors an FP8 checkpoint stores unquantized (its modules_to_not_convert,
    embeddings, norms), read from the safetensors headers alone."""
    from safetensors import safe_open

    out = []
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out += [n for n in h.keys() if n.endswith(".weight")
                    and not h.get_slice(n).get_dtype().startswith("F8")]
    return out


def dequantize_state(path: str | Path, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (a whole checkpoint read as stored) with each float8 weight of an FP8 blockwise
    checkpoint dequantized to float32 (`quantize.dequantize`, the loaders' function) and its
    `weight_scale_inv` dropped; an unquantized checkpoint's tensors are returned as they are."""
    import torch

    from milepost.lowprec.quantize import dequantize

    if fp8_checkpoint(path) is None:
        return tensors
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_INV_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors.get(name.removesuffix(".weight") + SCALE_INV_SUFFIX)
            t = dequantize(checkpoint_qtensor(name, t, scale))
        out[name] = t
    return out
