"""Which quantized checkpoint layout a model directory holds, and which engine store serves it as
stored (no torch: the run-config check calls this before any process starts).

Layouts read (config.json `quantization_config`), each held exactly by one existing store:
- `fp8_block`: HF `quant_method: fp8` with `weight_block_size: [128, 128]` (DeepSeek-V3,
  Qwen3-*-FP8, `milepost convert`; scales in `X.weight_scale_inv`), or compressed-tensors
  `float-quantized` with `strategy: block`, `block_structure: [128, 128]` (`X.weight_scale`).
- `fp8_tensor`: HF `quant_method: fp8` without `weight_block_size` (AutoFP8: one
  `X.weight_scale` per tensor) or compressed-tensors `strategy: tensor`: the blockwise store with
  every 128 x 128 tile given the tensor's scale.
- `fp8_channel`: compressed-tensors `strategy: channel` (the "FP8-dynamic" releases; `X.weight_scale`
  [out, 1]): the row-scaled `--quantization fp8` store (float8 values, a float32 scale per row),
  MoE experts too (lowprec/experts_fp8_row.py); dynamic per-token FP8 activations make
  `activation_scheme` "dynamic" (the dense linears W8A8, lowprec/fp8_dynamic.py), none "none".
- `int4_pack`: compressed-tensors `pack-quantized`, 4-bit symmetric ints, `strategy: group` with a
  group size that is a multiple of 128, or `channel` (`X.weight_packed` int32, eight values a word,
  stored +8; `X.weight_scale` [out, groups]; `X.weight_shape`): the packed INT4 store (128-wide groups,
  a coarser group's scale repeated); and 4-bit symmetric GPTQ (`quant_method: gptq`, formats gptq
  and gptq_v2, `desc_act` only with groups in order: `X.qweight` packed down the columns, the
  same values transposed); MoE experts' gate/up/down go to the packed INT4 expert store
  (lowprec/experts_int4.py), the same way. A finer group (32, 64) is read too, but no store holds it:
  serving it as stored is refused naming the group size (`inexact`); `--dequantize-checkpoint`
  (and training) take its dequantized weights.
- `int4_awq`: AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`, 4 bits, zero points:
  `X.qweight` int32 [in, out/8] in AWQ's interleaved nibble order, `X.qzeros`, `X.scales` fp16
  [groups, out]), and asymmetric GPTQ (`sym: false`, layout int4_gptq with `zero_points`): the
  packed INT4 store with a per-group zero point beside each scale (w = (q - z) * s), MoE experts
  too (the INT4 expert store keeps zero points the same way). compressed-tensors pack-quantized
  with `symmetric: false` (group or channel; `X.weight_zero_point` int32 [ceil(out/8), groups],
  packed down the output dim) is `int4_pack` with `zero_points`.
Anything else (another method, E5M2, other block sizes, activation ordering, kv-cache or
sparsity schemes, AWQ's kernel-specific versions) is refused naming the setting.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from milepost.lowprec.contract import COVERED
from milepost.lowprec.formats import FP8_TILE, INT4_GROUP

# The store (`--quantization`) that holds each layout exactly.
SERVED_AS = {"fp8_block": "fp8_block", "fp8_tensor": "fp8_block", "fp8_channel": "fp8",
             "int4_pack": "int4", "int4_gptq": "int4", "int4_awq": "int4"}
# Tensors read beside a quantized weight, per layout (by name suffix).
COMPANIONS = {
    "fp8_tensor": (".weight_scale",),
    "fp8_channel": (".weight_scale",),
    "int4_pack": (".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx"),
    "int4_gptq": (".scales", ".qzeros", ".g_idx"),
    "int4_awq": (".scales", ".qzeros"),
}
PACKED_SUFFIX = ".weight_packed"  # compressed-tensors pack-quantized: X.weight_packed holds X.weight
GPTQ_SUFFIX = ".qweight"  # GPTQ and AWQ: X.qweight holds X.weight


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's `quantization_config` says, checked."""

    layout: str  # fp8_block | fp8_tensor | fp8_channel | int4_pack | int4_gptq | int4_awq
    activation_scheme: str  # "dynamic" | "static" (then `X.input_scale` per linear) | "none" (weight-only)
    not_converted: tuple[str, ...]  # module names the checkpoint kept unquantized (informative)
    scale_suffix: str = ".weight_scale"  # the weight scale's name: X.weight -> X{scale_suffix}
    group_size: int = 0  # int4_pack: values per scale along a row (0: one scale per row)
    inexact: str = ""  # why no engine store holds the stored values as they are ("": one does)
    gptq_zero: int = 8  # int4_gptq: the stored zero nibble that means "symmetric" (v1 stores 7)
    # int4_awq, asymmetric int4_gptq (qzeros) and int4_pack (weight_zero_point): a zero point per group
    zero_points: bool = False

    @property
    def serve_as(self) -> str:
        """The engine `--quantization` that holds the stored values and scales exactly."""
        return SERVED_AS[self.layout]

    @property
    def companions(self) -> tuple[str, ...]:
        return COMPANIONS.get(self.layout, (self.scale_suffix,))


def checkpoint_quant(path: str | Path) -> CheckpointQuant | None:
    """The quantized layout of the checkpoint at `path`, None for an unquantized one; a layout
    the engines cannot hold exactly raises ValueError naming the setting."""
    cfg_file = Path(path) / "config.json"
    try:
        qc = json.loads(cfg_file.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None  # no readable config: the loader reports that itself
    if not qc:
        return None
    where = f"{cfg_file}: quantization_config"
    method = qc.get("quant_method")
    if method == "fp8":
        return _hf_fp8(qc, where)
    if method == "compressed-tensors":
        return _compressed(qc, where)
    if method == "gptq":
        return _gptq(qc, where)
    if method == "awq":
        return _awq(qc, where)
    raise ValueError(f"{where}.quant_method is {method!r}; milepost loads FP8 checkpoints (quant_method "
                     "fp8: blockwise or per-tensor), compressed-tensors FP8 (per-tensor, per-channel, "
                     "128 x 128 blocks) and INT4 (pack-quantized) ones, 4-bit GPTQ and "
                     "AWQ (gemm) ones, and unquantized ones: "
                     "use the bf16 checkpoint of this model (quantize it on load with --quantization)")


def _hf_fp8(qc: dict[str, Any], where: str) -> CheckpointQuant:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}.fmt is {fmt!r}; the engines hold FP8 as E4M3 (float8_e4m3fn) "
                         "only: use an e4m3 checkpoint or the bf16 one")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{where}.activation_scheme is {scheme!r}; expected dynamic or static")
    skipped = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is None:  # AutoFP8 / SGLang's per-tensor layout: X.weight_scale, one per tensor
        return CheckpointQuant("fp8_tensor", scheme, skipped)
    if list(block) != [FP8_TILE, FP8_TILE]:
        raise ValueError(f"{where}.weight_block_size is {list(block)}; the engines' FP8 tiles are "
                         f"[{FP8_TILE}, {FP8_TILE}] (DeepSeek-V3's): re-quantize the bf16 "
                         "checkpoint with `python -m milepost.lowprec.convert`")
    return CheckpointQuant("fp8_block", scheme, skipped, ".weight_scale_inv")


def _compressed(qc: dict[str, Any], where: str) -> CheckpointQuant:
    """compressed-tensors (llm-compressor's output): every config group must give the same
    weight scheme, one the stores hold."""
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise ValueError(f"{where}.{key} is set; milepost reads quantized weights only (no "
                             "kv-cache scales, sparsity or transforms): use the bf16 checkpoint")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}.quantization_status is {status!r}; milepost reads compressed "
                         "checkpoints (the stored values quantized): save it compressed or use the bf16 one")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}.config_groups is empty: nothing says how the weights are stored")
    found = {_group_layout(g, qc.get("format"), f"{where}.config_groups.{name}")
             for name, g in groups.items()}
    if len(found) > 1:
        raise ValueError(f"{where}.config_groups mix weight schemes {sorted(found)}; milepost serves "
                         "one scheme per checkpoint: use the bf16 checkpoint with --quantization")
    layout, scheme, group, zeros = found.pop()
    return CheckpointQuant(layout, scheme, tuple(qc.get("ignore") or ()), ".weight_scale", group,
                           _finer_group(group, where), zero_points=zeros)


def _finer_group(group: int, where: str) -> str:
    """Why an INT4 group size is not held exactly ("" when it is)."""
    if group % INT4_GROUP == 0:  # a multiple of 128, or 0: per channel
        return ""
    return (f"{where}: INT4 group_size {group}; the engines' INT4 store has one float32 scale "
            f"per {INT4_GROUP} values of a row, which holds multiples of {INT4_GROUP} (and "
            "per-channel scales) exactly, not finer groups: serve it with --dequantize-checkpoint "
            f"(its weights in --dtype), or --quantization int4 to re-quantize them in groups of "
            f"{INT4_GROUP}")


def _gptq(qc: dict[str, Any], where: str) -> CheckpointQuant:
    """GPTQ (AutoGPTQ / GPTQModel): `X.qweight` int32 [in/8, out] (eight values of a column per
    word, element 8i+j in bits 4j, stored unsigned), `X.qzeros` int32 [groups, out/8],
    `X.scales` [groups, out], `X.g_idx` [in]; w = scale * (q - zero). Symmetric 4-bit GPTQ has
    every zero 8 (format v1 stores zero - 1 = 7): the INT4 store's values are q - 8. With
    `sym: false` the zeros are read (v1: stored + 1) and kept beside the scales."""
    bits = qc.get("bits")
    if bits != 4:
        raise ValueError(f"{where}.bits is {bits!r}; the engines' INT4 store holds 4-bit GPTQ only: "
                         "use a 4-bit checkpoint or the bf16 one")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}.checkpoint_format is {fmt!r}; milepost reads gptq and gptq_v2 "
                         "(a kernel-specific repacking such as marlin is not read)")
    if qc.get("dynamic"):
        raise ValueError(f"{where}.dynamic sets per-module overrides; milepost reads one setting for "
                         "every module: use the bf16 checkpoint")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or group == 0 or group < -1:
        raise ValueError(f"{where}.group_size is {group!r}; expected a positive size or -1 (per channel)")
    group = 0 if group == -1 else group
    return CheckpointQuant("int4_gptq", "none", (), ".scales", group, _finer_group(group, where),
                           7 if fmt == "gptq" else 8, zero_points=not qc.get("sym", True))


def _awq(qc: dict[str, Any], where: str) -> CheckpointQuant:
    """AWQ (AutoAWQ, transformers' AwqConfig), GEMM version: `X.qweight` int32 [in, out/8] (eight
    values of a row per word in AWQ's interleaved order), `X.qzeros` int32 [groups, out/8] in the
    same order, `X.scales` fp16 [groups, out]; w = (q - zero) * scale, q and zero unsigned 0..15.
    The other versions repack the same values for one kernel (gemv, marlin, exllama, ipex) and
    are not read; nor is llm-awq's own packing (`backend: llm-awq`)."""
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}.bits is {bits!r}; the engines' INT4 store holds 4-bit AWQ only: "
                         "use a 4-bit checkpoint or the bf16 one")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}.version is {version!r}; milepost reads AWQ's gemm layout "
                         "(qweight [in, out/8]), not the kernel-specific repackings (gemv, marlin, "
                         "exllama, ipex): use the gemm checkpoint or the bf16 one")
    backend = qc.get("backend", "autoawq")
    if backend != "autoawq":
        raise ValueError(f"{where}.backend is {backend!r}; milepost reads AutoAWQ's packing "
                         "(backend autoawq), not llm-awq's: use the bf16 checkpoint")
    if not qc.get("zero_point", True):
        raise ValueError(f"{where}.zero_point is false; AutoAWQ's gemm layout stores zero points "
                         "(its packer needs them): a checkpoint without them is not one milepost "
                         "reads: use the bf16 checkpoint")
    for key in ("desc_act", "act_order"):
        if qc.get(key):
            raise ValueError(f"{where}.{key} is set: columns quantized out of order; the INT4 "
                             "store's groups are contiguous: use the bf16 checkpoint")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or group == 0 or group < -1:
        raise ValueError(f"{where}.group_size is {group!r}; expected a positive size or -1 (per channel)")
    group = 0 if group == -1 else group
    return CheckpointQuant("int4_awq", "none", tuple(qc.get("modules_to_not_convert") or ()),
                           ".scales", group, _finer_group(group, where), zero_points=True)


def _group_layout(g: dict[str, Any], top_format: str | None, where: str
                  ) -> tuple[str, str, int, bool]:
    """(layout, activation scheme, int4 group size, zero points) of one compressed-tensors
    config group. Zero points (`symmetric: false`) are read for INT4 only, where the packed
    store keeps one per 128-wide group; the FP8 stores have none."""
    w = g.get("weights") or {}
    fmt = g.get("format") or top_format
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if g.get("output_activations"):
        raise ValueError(f"{where}.output_activations is set; milepost quantizes no outputs")
    if w.get("dynamic"):
        raise ValueError(f"{where}.weights.dynamic is true: no stored weight scales to serve")
    zeros = not w.get("symmetric", True)
    if zeros and not (kind == "int" and bits == 4):
        raise ValueError(f"{where}.weights.symmetric is false: zero points on {bits}-bit {kind!r} "
                         "weights; the engines' FP8 stores are symmetric (zero points are read for "
                         "INT4 pack-quantized weights only): use a symmetric checkpoint or the "
                         "bf16 one")
    act = g.get("input_activations")
    if kind == "float" and bits == 8:
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"{where}: format {fmt!r} for FP8 weights; expected float-quantized")
        scheme = "none" if not act else ("dynamic" if act.get("dynamic") else "static")
        if strategy == "tensor":
            return ("fp8_tensor", scheme if scheme != "none" else "dynamic", 0, False)
        if strategy == "channel":
            if scheme == "static":
                raise ValueError(f"{where}: per-channel FP8 weights with static input scales; the "
                                 "row-scaled store (--quantization fp8) quantizes no inputs: use "
                                 "a dynamic-activation checkpoint or the bf16 one")
            if scheme == "none":
                return ("fp8_channel", "none", 0, False)
            if (act.get("type"), act.get("num_bits"), act.get("strategy")) != ("float", 8, "token"):
                raise ValueError(f"{where}.input_activations: dynamic {act.get('num_bits')}-bit "
                                 f"{act.get('type')!r} per {act.get('strategy')!r}; per-channel FP8 "
                                 "weights are served with dynamic 8-bit float activations per "
                                 "token (FP8-dynamic) or none: use such a checkpoint or the bf16 one")
            # FP8-dynamic: activations per token at run time (the row store's W8A8 forward,
            # kernels/fp8_rowwise.py) unless the engine is started with --fp8-weight-only.
            return ("fp8_channel", "dynamic", 0, False)
        if strategy == "block":
            block = list(w.get("block_structure") or [])
            if block != [FP8_TILE, FP8_TILE]:
                raise ValueError(f"{where}.weights.block_structure is {block}; the engines' FP8 "
                                 f"tiles are [{FP8_TILE}, {FP8_TILE}]: use the bf16 checkpoint")
            return ("fp8_block", scheme if scheme != "none" else "dynamic", 0, False)
        raise ValueError(f"{where}.weights.strategy is {strategy!r} for FP8; milepost holds "
                         "tensor, channel and 128 x 128 block scales: use the bf16 checkpoint")
    if kind == "int" and bits == 4:
        if fmt != "pack-quantized":
            raise ValueError(f"{where}: format {fmt!r} for INT4 weights; expected pack-quantized")
        if act:
            raise ValueError(f"{where}.input_activations is set (W4A8); the INT4 store is "
                             "weight-only (W4A16): use a W4A16 checkpoint or the bf16 one")
        if w.get("actorder") == "group":
            raise ValueError(f"{where}.weights.actorder is 'group': columns are grouped out of "
                             "order (weight_g_idx); the INT4 store's groups are contiguous: use a "
                             "checkpoint quantized without actorder=group (static/weight are fine)")
        if strategy == "channel":
            return ("int4_pack", "none", 0, zeros)
        size = w.get("group_size")
        if strategy != "group" or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{where}.weights: strategy {strategy!r}, group_size {size!r}; "
                             "expected group (with a positive group_size) or channel")
        return ("int4_pack", "none", size, zeros)
    raise ValueError(f"{where}.weights: {bits}-bit {kind!r}; milepost reads 8-bit float (FP8) and "
                     "4-bit int (W4A16) compressed-tensors weights: use the bf16 checkpoint")


def unheld_weights(path: str | Path, ckpt: CheckpointQuant) -> list[str]:
    """The quantized weights of a per-channel FP8 or INT4 checkpoint that its store would not hold
    (projections outside q/k/v/o and gate/up/down; MoE experts go to the FP8 row-scaled and
    packed INT4 expert stores, lowprec/experts_fp8_row.py, experts_int4.py): serving the
    checkpoint as stored is refused for them (they would be dequantized into --dtype, which
    rounds in bf16). Read from the safetensors headers alone (no torch)."""
    if ckpt.layout not in ("fp8_channel", "int4_pack", "int4_gptq", "int4_awq"):
        return []  # the blockwise store: tensors outside its recipe are dequantized (documented)
    out = []
    for f in sorted(Path(path).glob("*.safetensors")):
        for name, meta in _header(f).items():
            packed = {"int4_pack": PACKED_SUFFIX, "int4_gptq": GPTQ_SUFFIX,
                      "int4_awq": GPTQ_SUFFIX}.get(ckpt.layout)
            if packed and name.endswith(packed):
                name = name.removesuffix(packed) + ".weight"
            elif meta.get("dtype") != "F8_E4M3":  # a float8 tensor not named X.weight (a
                continue  # stacked expert tensor) is held by no store either
            module = name.removesuffix(".weight").rsplit(".", 1)[-1]
            if module not in COVERED:
                out.append(name)
    return sorted(out)


def _header(f: Path) -> dict[str, dict[str, Any]]:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets}."""
    with f.open("rb") as h:
        (size,) = struct.unpack("<Q", h.read(8))
        header = json.loads(h.read(size))
    header.pop("__metadata__", None)
    return header
