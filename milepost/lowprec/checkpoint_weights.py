"""A quantized checkpoint's weights as the engine stores them (lowprec/quant_checkpoint.py says
which layout): each stored weight becomes a QTensor with no arithmetic on its values, and its
dequantization is the function the engine's store multiplies with, so the model loader, the
trainers and the engines agree bit for bit on what the checkpoint means.

- FP8 blockwise: the float8 values and their tile scales (`quantize.dequantize`).
- FP8 per-tensor: the same, every 128 x 128 tile given the tensor's scale.
- FP8 per-channel: fmt "fp8_row": float8 values, a float32 scale per row (the row-scaled
  `--quantization fp8` store; `weights.fp8.dequantize_rows`).
- INT4 pack-quantized: the values unpacked from their int32 words (element 8j+i in bits 4i..4i+3,
  stored +8) and packed as the engine packs them (two's complement, element 2i in the low nibble:
  a re-encoding of the same values, `elements.pack_int4`); float32 scales per 128-wide group (a
  coarser group's scale repeated), or per the checkpoint's finer group for dequantization only.
- INT4 GPTQ (4-bit): the same, from its column-packed words (a transpose); asymmetric ones
  (`sym: false`) keep each group's zero point beside its scale (QTensor.zeros, zero - 8).
- INT4 AWQ (gemm): the same from row-packed words in AWQ's interleaved order, with zero points.
- INT4 pack-quantized with `symmetric: false`: as symmetric, plus `X.weight_zero_point` (int32
  [ceil(out/8), groups], eight zero points of a column per word down the output dim, element 8j+i
  in bits 4i..4i+3, stored + 8 as the values are), kept beside the scales.
Scales stored in bf16 / fp16 widen to float32 exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from milepost.lowprec import elements as el
from milepost.lowprec.formats import FP8_TILE, INT4_GROUP
from milepost.lowprec.quant_checkpoint import GPTQ_SUFFIX, PACKED_SUFFIX, CheckpointQuant
from milepost.lowprec.quantize import QTensor, dequantize
from milepost.weights.fp8 import dequantize_rows

Get = Callable[[str], "torch.Tensor | None"]  # a companion tensor by name (None: not in the checkpoint)
_PACKED = {"int4_pack": PACKED_SUFFIX, "int4_gptq": GPTQ_SUFFIX, "int4_awq": GPTQ_SUFFIX}
# AWQ's packing (AutoAWQ's gemm layout): nibble i of a word (bits 4i..4i+3) holds element
# _AWQ_ORDER[i] of its eight; so element e sits in nibble _AWQ_NIBBLE[e].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_NIBBLE = tuple(_AWQ_ORDER.index(e) for e in range(8))


def weight_name(ckpt: CheckpointQuant | None, stored: str) -> str:
    """The model's HF weight name a stored tensor holds (`X.weight_packed`, `X.qweight` -> `X.weight`)."""
    suffix = _PACKED.get(ckpt.layout) if ckpt is not None else None
    if suffix is not None and stored.endswith(suffix):
        return stored.removesuffix(suffix) + ".weight"
    return stored


def is_companion(ckpt: CheckpointQuant | None, stored: str) -> bool:
    """A tensor read beside its weight (scales, shapes), not a weight of the model."""
    return ckpt is not None and stored.endswith(ckpt.companions)


def is_quantized(ckpt: CheckpointQuant | None, stored: str, dtype: torch.dtype) -> bool:
    if ckpt is None:
        return False
    if ckpt.layout in _PACKED:
        return stored.endswith(_PACKED[ckpt.layout])
    return dtype == torch.float8_e4m3fn and stored.endswith(".weight")


def read_weight(ckpt: CheckpointQuant, name: str, stored: torch.Tensor, get: Get) -> QTensor:
    """The QTensor of HF weight `name` from its stored tensor and companions (read with `get`);
    a missing or misshapen companion is refused naming it."""
    base = name.removesuffix(".weight")
    scale = get(base + ckpt.scale_suffix)
    if ckpt.layout == "int4_pack":
        return _int4(ckpt, name, stored, scale, get)
    if ckpt.layout == "int4_gptq":
        return _gptq(ckpt, name, stored, scale, get)
    if ckpt.layout == "int4_awq":
        return _awq(ckpt, name, stored, scale, get)
    if stored.dim() != 2:
        raise ValueError(f"{name}: an FP8 weight of shape {list(stored.shape)}; the engines load "
                         "2-d FP8 linears (per-expert names for MoE experts), not stacked ones")
    if scale is None:
        raise ValueError(f"{name} is float8_e4m3fn but the checkpoint has no {base}{ckpt.scale_suffix}")
    rows, cols = stored.shape
    tiles = (-(-rows // FP8_TILE), -(-cols // FP8_TILE))
    # float32 as stored (bf16 scales widen exactly): the multiplier every stage dequantizes with.
    if ckpt.layout == "fp8_block":
        _want(scale, tiles, f"{base}{ckpt.scale_suffix}", f"{FP8_TILE} x {FP8_TILE} tiles of a "
              f"{list(stored.shape)} weight")
        return QTensor("fp8_block", stored, scale.float(), (FP8_TILE, FP8_TILE), (rows, cols))
    if ckpt.layout == "fp8_tensor":
        if scale.numel() != 1:
            raise ValueError(f"{base}{ckpt.scale_suffix} has shape {list(scale.shape)}; a per-tensor "
                             "FP8 checkpoint has one scale per weight")
        return QTensor("fp8_block", stored, scale.float().reshape(1, 1).expand(tiles).contiguous(),
                       (FP8_TILE, FP8_TILE), (rows, cols))
    if scale.numel() != rows or scale.dim() not in (1, 2) or scale.shape[0] != rows:
        raise ValueError(f"{base}{ckpt.scale_suffix} has shape {list(scale.shape)}; per-channel "
                         f"scales of a {list(stored.shape)} weight are [{rows}, 1]")
    return QTensor("fp8_row", stored, scale.float().reshape(rows, 1), (1, cols), (rows, cols))


def _int4(ckpt: CheckpointQuant, name: str, packed: torch.Tensor, scale: torch.Tensor | None,
          get: Get) -> QTensor:
    base = name.removesuffix(".weight")
    shape_t = get(base + ".weight_shape")
    if shape_t is None or scale is None:
        missing = base + (".weight_shape" if shape_t is None else ckpt.scale_suffix)
        raise ValueError(f"{base}{PACKED_SUFFIX} has no {missing} in the checkpoint")
    rows, cols = (int(v) for v in shape_t.tolist())
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, -(-cols // 8)):
        raise ValueError(f"{base}{PACKED_SUFFIX} is {packed.dtype} {list(packed.shape)}; a "
                         f"[{rows}, {cols}] weight packs into int32 [{rows}, {-(-cols // 8)}]")
    zp = get(base + ".weight_zero_point")
    if zp is not None and not ckpt.zero_points:
        raise ValueError(f"{base}.weight_zero_point: a zero point in a symmetric checkpoint "
                         "(weights.symmetric is true): fix the config (symmetric: false) or use "
                         "the bf16 checkpoint")
    if zp is None and ckpt.zero_points:
        raise ValueError(f"{base}{PACKED_SUFFIX} has no {base}.weight_zero_point in the checkpoint "
                         "(weights.symmetric is false)")
    group = ckpt.group_size or cols  # channel: one group spanning the row
    g_idx = get(base + ".weight_g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(cols) // group):
        raise ValueError(f"{base}.weight_g_idx groups columns out of order (activation ordering); "
                         "the INT4 store's groups are contiguous: use the bf16 checkpoint")
    _want(scale, (rows, -(-cols // group)), base + ckpt.scale_suffix,
          f"groups of {group} in a [{rows}, {cols}] weight")
    # Word j of a row holds elements 8j..8j+7, element 8j+i in bits 4i..4i+3, each stored as
    # value + 8 (so -8..7 -> 0..15). Read as little-endian bytes, that is the store's order
    # (element 2i low nibble, 2i+1 high), so the store's two's-complement nibbles are the bytes
    # XOR 0x88: one pass instead of unpacking (a 30B-A3B expert: 0.04 ms vs 10.6 ms on the CPU).
    if cols % 2 == 0 and sys.byteorder == "little":
        codes = packed.contiguous().view(torch.uint8)[:, : cols // 2] ^ 0x88
    else:  # by the definition
        codes = el.pack_int4((_nibbles(packed)[:, :cols] - 8).to(torch.int8))
    offsets = None
    if zp is not None:  # packed down the columns: word j of a column holds rows 8j..8j+7
        groups = -(-cols // group)
        if zp.dtype != torch.int32 or tuple(zp.shape) != (-(-rows // 8), groups):
            raise ValueError(f"{base}.weight_zero_point is {zp.dtype} {list(zp.shape)}; zero points "
                             f"of groups of {group} in a [{rows}, {cols}] weight pack into int32 "
                             f"[{-(-rows // 8)}, {groups}]")
        z = _nibbles(zp.t().contiguous())[:, :rows].t()  # [rows, groups], unsigned: zero + 8
        # The values are stored as v (signed), so the store's offset is the signed zero itself.
        offsets = _zero_offsets(z)
    return _int4_qtensor(ckpt, codes, scale.float(), group, offsets, packed_cols=cols)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] -> the eight unsigned 4-bit fields of each word, low bits first: [r, 8c]."""
    w = words.to(torch.int64)
    return torch.stack([(w >> (4 * i)) & 15 for i in range(8)], dim=-1).reshape(w.shape[0], -1)


def _int4_qtensor(ckpt: CheckpointQuant, values: torch.Tensor, scales: torch.Tensor, group: int,
                  zeros: torch.Tensor | None = None, packed_cols: int | None = None) -> QTensor:
    """int8 `values` [rows, cols] (-8..7), or with packed_cols = cols already el.pack_int4's
    bytes; float32 `scales` and int8 `zeros` (zero - 8, or None) [rows, ceil(cols/group)] as the
    INT4 store holds them: a group that is a multiple of 128 (or the row) gives each 128-wide
    group its scale and zero; a finer group is kept as it is (dequantization only: `inexact`)."""
    rows, cols = values.shape[0], packed_cols or values.shape[1]
    if not ckpt.group_size or group % INT4_GROUP == 0:
        per = -(-group // INT4_GROUP)
        scales = scales.repeat_interleave(per, dim=1)[:, :-(-cols // INT4_GROUP)]
        if zeros is not None:
            zeros = zeros.repeat_interleave(per, dim=1)[:, :-(-cols // INT4_GROUP)]
        group = INT4_GROUP
    codes = values if packed_cols else el.pack_int4(values)
    return QTensor("int4", codes, scales.contiguous(), (1, group), (rows, cols),
                   zeros=zeros.contiguous() if zeros is not None else None)


def _gptq(ckpt: CheckpointQuant, name: str, qweight: torch.Tensor, scale: torch.Tensor | None,
          get: Get) -> QTensor:
    """GPTQ's column-packed tensors (quant_checkpoint._gptq) as the INT4 store's rows: a
    transpose and a re-encoding of the same 4-bit values, no arithmetic on them."""
    base = name.removesuffix(".weight")
    zeros = get(base + ".qzeros")
    if scale is None or zeros is None:
        missing = base + (".scales" if scale is None else ".qzeros")
        raise ValueError(f"{base}{GPTQ_SUFFIX} has no {missing} in the checkpoint")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{base}{GPTQ_SUFFIX} is {qweight.dtype} {list(qweight.shape)}; GPTQ packs "
                         "a weight into int32 [in/8, out]")
    cols, rows = qweight.shape[0] * 8, qweight.shape[1]  # in features, out features
    group = ckpt.group_size or cols
    groups = -(-cols // group)
    _want(scale, (groups, rows), base + ".scales", f"groups of {group} in a [{rows}, {cols}] weight")
    _want(zeros, (groups, -(-rows // 8)), base + ".qzeros", f"groups of {group} of {rows} columns")
    z = _nibbles(zeros)[:, :rows]
    if not ckpt.zero_points and not (z == ckpt.gptq_zero).all():
        raise ValueError(f"{base}.qzeros holds zero points other than {ckpt.gptq_zero} (symmetric "
                         f"in this checkpoint_format) but quantization_config.sym is true: a "
                         "checkpoint with zero points says sym: false (or its checkpoint_format "
                         "is wrong); fix the config or use the bf16 checkpoint")
    g_idx = get(base + ".g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(cols) // group):
        raise ValueError(f"{base}.g_idx groups columns out of order (desc_act); the INT4 store's "
                         "groups are contiguous: use the bf16 checkpoint")
    # sym: false keeps the zero points; v2 stores each as it is, v1 as zero - 1 (so a stored 7
    # is the symmetric 8 in both).
    offsets = _zero_offsets(z.t() + 8 - ckpt.gptq_zero) if ckpt.zero_points else None
    return _int4_qtensor(ckpt, _gptq_codes(qweight), scale.float().t(), group, offsets,
                         packed_cols=cols)


def _gptq_codes(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's int32 [in/8, out] -> the store's bytes [out, in/2]. Word i of a column holds its
    elements 8i..8i+7 (element 8i+j in bits 4j), stored unsigned: as little-endian bytes, byte b
    of word i holds the column's elements 8i+2b (low nibble) and 8i+2b+1, i.e. the store's byte
    4i+b of that row once transposed, and the store's two's-complement nibble of u - 8 is u ^ 8."""
    if sys.byteorder != "little":  # by the definition
        u = _nibbles(qweight.t().contiguous())  # [out, in]: a column's words become a row's
        return el.pack_int4((u - 8).to(torch.int8))
    words, out = qweight.shape
    as_bytes = qweight.contiguous().view(torch.uint8).reshape(words, out, 4)
    return as_bytes.permute(1, 0, 2).reshape(out, words * 4) ^ 0x88


def _zero_offsets(z: torch.Tensor) -> torch.Tensor:
    """Zero points z [rows, groups] as the store keeps them: z - 8, so that with the values
    stored as q - 8, (v - offset) = q - z exactly, and a symmetric zero (8) is 0."""
    return (z.to(torch.int16) - 8).to(torch.int8)


def _awq(ckpt: CheckpointQuant, name: str, qweight: torch.Tensor, scale: torch.Tensor | None,
         get: Get) -> QTensor:
    """AWQ's row-packed tensors (quant_checkpoint._awq) as the INT4 store's rows and zero points:
    the nibbles put back in element order, transposed; no arithmetic on the values."""
    base = name.removesuffix(".weight")
    zeros = get(base + ".qzeros")
    if scale is None or zeros is None:
        missing = base + (".scales" if scale is None else ".qzeros")
        raise ValueError(f"{base}{GPTQ_SUFFIX} has no {missing} in the checkpoint")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"{base}{GPTQ_SUFFIX} is {qweight.dtype} {list(qweight.shape)}; AWQ packs "
                         "a weight into int32 [in, out/8]")
    cols, rows = qweight.shape[0], qweight.shape[1] * 8  # in features, out features
    group = ckpt.group_size or cols
    groups = -(-cols // group)
    _want(scale, (groups, rows), base + ".scales", f"groups of {group} in a [{rows}, {cols}] weight")
    _want(zeros, (groups, rows // 8), base + ".qzeros", f"groups of {group} of {rows} outputs")
    q = _awq_elements(qweight).t()  # [out, in], unsigned 0..15
    z = _awq_elements(zeros).t()  # [out, groups]
    return _int4_qtensor(ckpt, (q - 8).to(torch.int8), scale.float().t(), group, _zero_offsets(z))


def _awq_elements(words: torch.Tensor) -> torch.Tensor:
    """int32 [r, c] packed in AWQ's order -> the unsigned 4-bit elements [r, 8c] in order."""
    nib = _nibbles(words)  # nibble i of word j at 8j + i
    return nib.reshape(words.shape[0], -1, 8)[:, :, list(_AWQ_NIBBLE)].reshape(words.shape[0], -1)


def _want(t: torch.Tensor, shape: tuple[int, int], name: str, what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {list(t.shape)}; {what} need {list(shape)}")


def dequantize_weight(q: QTensor) -> torch.Tensor:
    """float32 values of a checkpoint weight: what the engine's store multiplies."""
    if q.fmt == "fp8_row":
        return dequantize_rows(q.values, q.scales.reshape(-1))
    return dequantize(q)


def on_device(q: QTensor, device: torch.device | str) -> QTensor:
    return QTensor(q.fmt, q.values.to(device), q.scales.to(device), q.tile, q.shape, q.tensor_scale,
                   q.zeros.to(device) if q.zeros is not None else None)


def dequantize_tensors(ckpt: CheckpointQuant | None, tensors: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """`tensors` (a whole checkpoint read as stored) with each quantized weight dequantized to
    float32 under its HF name and its companions dropped; unquantized ones returned as they are."""
    if ckpt is None:
        return tensors
    out = {}
    for stored, t in tensors.items():
        if is_companion(ckpt, stored):
            continue
        name = weight_name(ckpt, stored)
        if is_quantized(ckpt, stored, t.dtype):
            t = dequantize_weight(read_weight(ckpt, name, t, tensors.get))
        out[name] = t
    return out


def pack_quantized(q: QTensor) -> dict[str, torch.Tensor]:
    """An INT4 QTensor (groups of 128, the shared quantizer's) as compressed-tensors
    pack-quantized tensors, suffix -> tensor: `.weight_packed` (int32 [rows, ceil(cols/8)], the
    inverse of `_int4`'s unpacking), `.weight_scale` (float32, as the quantizer made them) and
    `.weight_shape`. `read_weight` gives `q` back bit for bit."""
    rows, cols = q.shape
    u = el.unpack_int4(q.values, cols).to(torch.int64) + 8  # stored unsigned: v + 8
    u = torch.nn.functional.pad(u, (0, -cols % 8))
    words = (u.reshape(rows, -1, 8) << (4 * torch.arange(8, device=u.device))).sum(-1)
    signed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits
    return {".weight_packed": signed, ".weight_scale": q.scales.float(),
            ".weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}
