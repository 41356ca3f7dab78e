"""Tiny quantized checkpoints written by hand from the layouts' definitions (no milepost
quantizer, no compressed-tensors package): per-tensor FP8 (AutoFP8's `quant_method: fp8` without
`weight_block_size`, and compressed-tensors `strategy: tensor`), per-channel FP8
(compressed-tensors "FP8-dynamic"), INT4 pack-quantized (compressed-tensors W4A16), 4-bit GPTQ
(format v1 and v2, symmetric or with zero points) and AWQ (AutoAWQ's gemm layout). Each
covered projection gets random codes and random scales; `meaning` gives the float32 weight the
checkpoint means (codes times scales), for tests to compare the loaders against."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

COVERED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def covered(name: str, keep: tuple[str, ...] = ()) -> bool:
    """A projection weight the writers quantize (not under a module name in `keep`)."""
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and module.rsplit(".", 1)[-1] in COVERED
            and not any(module.startswith(k) for k in keep))


def fp8_codes(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    return codes.view(torch.float8_e4m3fn)


def pack_int4_words(values: torch.Tensor) -> torch.Tensor:
    """int values -8..7 [rows, cols] -> int32 [rows, ceil(cols/8)] as compressed-tensors packs
    them: each value stored + 8 (0..15), element 8j+i of a row in bits 4i..4i+3 of word j, the
    last word padded with stored zeros."""
    rows, cols = values.shape
    u = (values.to(torch.int64) + 8)
    u = torch.nn.functional.pad(u, (0, -cols % 8))
    words = (u.reshape(rows, -1, 8) << (4 * torch.arange(8))).sum(-1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits, signed


def _config(src: Path, dst: Path, qc: dict[str, Any]) -> None:
    """config.json with `qc`; the source's other files (tokenizer) copied as they are."""
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))


def compressed_config(weights: dict[str, Any], inputs: dict[str, Any] | None, fmt: str,
                      ignore: list[str]) -> dict[str, Any]:
    """A compressed-tensors quantization_config as llm-compressor writes one (one config group)."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs, "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None}


def write_fp8(src: Path, dst: Path, scales: str, style: str = "compressed-tensors",
              keep: tuple[str, ...] = (), seed: int = 5, input_scale: float | None = None,
              ) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint with one scale per tensor (`scales="tensor"`) or per output row
    (`"channel"`); `style` "hf" writes AutoFP8's layout (per-tensor only). Modules under `keep`
    stay in bf16 (the ignore list). `input_scale`: static activation scales, this value for
    every quantized linear (`X.input_scale`). Returns the tensors written."""
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for n, t in load_file(src / "model.safetensors").items():
        if not covered(n, keep):
            out[n] = t
            continue
        out[n] = fp8_codes(tuple(t.shape), g)
        rows = t.shape[0]
        s = torch.rand((rows, 1) if scales == "channel" else (1,), generator=g) * 1e-3 + 1e-5
        # compressed-tensors stores scales in the model dtype (bf16); AutoFP8 in float32, as a scalar.
        out[n.removesuffix("weight") + "weight_scale"] = s.reshape(()) if style == "hf" else s.bfloat16()
        if input_scale is not None:
            out[n.removesuffix("weight") + "input_scale"] = torch.tensor([input_scale])
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    ignore = ["lm_head", *keep]
    if style == "hf":
        scheme = "static" if input_scale is not None else "dynamic"
        qc = {"quant_method": "fp8", "activation_scheme": scheme, "ignored_layers": ignore}
    else:
        inputs = ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
                  if input_scale is not None else
                  {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True})
        qc = compressed_config(
            {"num_bits": 8, "type": "float", "strategy": scales, "symmetric": True, "dynamic": False},
            inputs, "float-quantized", ignore)
    _config(src, dst, qc)
    return out


def write_int4(src: Path, dst: Path, group: int, seed: int = 6,
               amax_seven: bool = False, sym: bool = True) -> dict[str, torch.Tensor]:
    """A compressed-tensors W4A16 checkpoint (pack-quantized, `group` values per scale along a
    row; 0: one scale per row). Each covered weight gets random values v in -8..7
    (`X.weight_packed`: eight a word along the row, stored + 8), random bf16 scales [out, groups]
    (`X.weight_scale`) and `X.weight_shape`. `amax_seven`: values -7..7 with a 7 in every group,
    as a quantizer scaling amax to 7 makes them (milepost's INT4 quantizer gives such values
    back). `sym` False (`symmetric: false`): random zero points z in -8..7 per row and group,
    stored as compressed-tensors packs them: + 8, eight rows of a group column per int32 word
    (`X.weight_zero_point` [ceil(out/8), groups], row 8j+i in bits 4i..4i+3 of word j); the
    weight is (v - z) * scale. Returns the tensors written, with each weight's ints (v, or
    v - z) under `X.values` (not in the file) for `meaning`."""
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
        v = torch.randint(-7 if amax_seven else -8, 8, (rows, cols), generator=g, dtype=torch.int8)
        if amax_seven:
            v[:, ::width] = 7
        z = None if sym else torch.randint(-8, 8, (rows, groups), generator=g, dtype=torch.int8)
        out[base + ".weight_packed"] = pack_int4_words(v)
        out[base + ".weight_scale"] = (torch.rand(rows, groups, generator=g) * 1e-2 + 1e-4).bfloat16()
        out[base + ".weight_shape"] = torch.tensor([rows, cols])
        kept[base + ".values"] = v
        if z is not None:
            # Down the output dim: pack the transpose along its rows, then transpose back.
            out[base + ".weight_zero_point"] = pack_int4_words(z.t().contiguous()).t().contiguous()
            kept[base + ".values"] = v.to(torch.int16) - z.to(torch.int16).repeat_interleave(width, 1)[:, :cols]
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    _config(src, dst, compressed_config(
        {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False, **strategy}, None,
        "pack-quantized", ["lm_head"]))
    return {**out, **kept}


def write_gptq(src: Path, dst: Path, group: int, v1: bool = True, seed: int = 7,
               sym: bool = True) -> dict[str, torch.Tensor]:
    """A 4-bit GPTQ checkpoint (AutoGPTQ's layout; `v1`: checkpoint_format gptq, whose
    qzeros store zero - 1): `X.qweight` int32 [in/8, out], eight values of a column per word
    (element 8i+j in bits 4j, stored unsigned q = value + 8); `X.qzeros` int32 [groups, out/8]
    packed the same way along the columns; `X.scales` fp16 [groups, out]; `X.g_idx` int32 [in].
    `group` 0: per channel (group_size -1). `sym` False: random zero points (`sym: false`), the
    weight being (q - zero) * scale. Returns the tensors written plus each weight's ints
    (q - zero) under `X.values`."""
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
        v = torch.randint(-8, 8, (rows, cols), generator=g, dtype=torch.int8)
        width = group or cols
        groups = -(-cols // width)
        out[base + ".qweight"] = pack_int4_words(v).t().contiguous()  # packed along `in`
        stored = (torch.full((groups, rows), 7 if v1 else 8, dtype=torch.int8) if sym
                  else torch.randint(0, 16, (groups, rows), generator=g, dtype=torch.int8))
        out[base + ".qzeros"] = pack_int4_words(stored - 8)  # as values: +8 on packing
        out[base + ".scales"] = (torch.rand(groups, rows, generator=g) * 1e-2 + 1e-4).half()
        out[base + ".g_idx"] = (torch.arange(cols) // width).to(torch.int32)
        zero = stored.to(torch.int16) + (1 if v1 else 0)  # v1 stores zero - 1
        # q - zero per element: q = v + 8, the zero of each element's group.
        kept[base + ".values"] = v + 8 - zero.t().repeat_interleave(width, dim=1)[:, :cols]
        kept[base + ".weight_scale"] = out[base + ".scales"].t()  # for `meaning`
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    _config(src, dst, {"quant_method": "gptq", "bits": 4, "group_size": group or -1, "sym": sym,
                       "desc_act": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"})
    return {**out, **kept}


# AutoAWQ's gemm packing, from its definition: nibble i of a word (bits 4i..4i+3) holds element
# AWQ_ORDER[i] of the word's eight consecutive elements along the output dim.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq_words(q: torch.Tensor) -> torch.Tensor:
    """unsigned 4-bit ints 0..15 [rows, cols] (cols a multiple of 8) -> int32 [rows, cols/8] in
    AWQ's interleaved order."""
    rows, cols = q.shape
    eight = q.to(torch.int64).reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for nibble, element in enumerate(AWQ_ORDER):
        words |= eight[:, :, element] << (4 * nibble)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits, signed


def write_awq(src: Path, dst: Path, group: int, seed: int = 8, keep: tuple[str, ...] = (),
              version: str = "gemm") -> dict[str, torch.Tensor]:
    """An AWQ checkpoint (AutoAWQ's gemm layout, as transformers' AwqConfig describes it):
    `X.qweight` int32 [in, out/8] (the weight transposed, eight outputs a word in AWQ_ORDER),
    `X.qzeros` int32 [groups, out/8] the same way, `X.scales` fp16 [groups, out]; the weight is
    (q - zero) * scale with q and zero unsigned 0..15. Random q, zeros and scales; `group` 0:
    per channel (group_size -1); modules under `keep` stay unquantized (modules_to_not_convert).
    Returns the tensors written plus each weight's ints (q - zero) under `X.values` and its
    scales [out, groups] under `X.weight_scale`, for `meaning`."""
    dst.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    kept: dict[str, torch.Tensor] = {}
    for n, t in load_file(src / "model.safetensors").items():
        if not covered(n, keep):
            out[n] = t
            continue
        rows, cols = t.shape  # out, in
        base = n.removesuffix(".weight")
        width = group or cols
        groups = -(-cols // width)
        q = torch.randint(0, 16, (rows, cols), generator=g)
        zero = torch.randint(0, 16, (rows, groups), generator=g)
        scales = (torch.rand(groups, rows, generator=g) * 1e-2 + 1e-4).half()
        out[base + ".qweight"] = pack_awq_words(q.t().contiguous())
        out[base + ".qzeros"] = pack_awq_words(zero.t().contiguous())
        out[base + ".scales"] = scales
        kept[base + ".values"] = q - zero.repeat_interleave(width, dim=1)[:, :cols]
        kept[base + ".weight_scale"] = scales.t()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    _config(src, dst, {"quant_method": "awq", "bits": 4, "group_size": group or -1,
                       "zero_point": True, "version": version,
                       "modules_to_not_convert": list(keep) or None})
    return {**out, **kept}


def meaning(out: dict[str, torch.Tensor], name: str, group: int = 0) -> torch.Tensor:
    """The float32 weight `name` of a written checkpoint means: codes (or ints) times their
    scale, the scale broadcast over its tensor, row or group (`group` for INT4; 0: per row)."""
    base = name.removesuffix(".weight")
    s = out[base + ".weight_scale"].float()
    if base + ".values" in out:
        v = out[base + ".values"].float()
        width = group or v.shape[1]
        return v * s.repeat_interleave(width, dim=1)[:, :v.shape[1]]
    w = out[name].float()
    return w * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
