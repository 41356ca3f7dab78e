"""Checkpoint conversion, the contract's fourth stage: a Hugging Face checkpoint to FP8 blockwise
in the layout SGLang and DeepSeek-V3 checkpoints use (`weight` float8_e4m3fn, `weight_scale_inv`
float32 per 128 x 128 tile, `quantization_config` in config.json), or to INT4 W4A16 in
compressed-tensors' pack-quantized layout (`weight_packed` int32, `weight_scale` float32 per 128
values of a row, symmetric), quantized by the same function the trainer and the engines call. A source exported by a trainer under `--fp8-scaling
delayed` holds each FP8 linear's `input_scale` (float32): they are kept and the checkpoint says
`activation_scheme: static`, as FP8 checkpoints with calibrated activation scales do.

    python -m milepost.lowprec.convert SRC_DIR DST_DIR [--format fp8_block|int4]
        [--precision-override layers.0-0=bf16 ...] [--precision-bf16-first-layers N]
        [--precision-bf16-last-layers M]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from milepost.lowprec.contract import BF16, Contract, layer_overrides, parse_overrides
from milepost.lowprec.delayed import input_scale_name
from milepost.lowprec.engine_scales import SCALE_SUFFIX
from milepost.lowprec.quantize import FP8_TILE, INT4_GROUP, quantize


def convert_checkpoint(src: Path, dst: Path, contract: Contract) -> list[str]:
    """Write `dst` from `src` with the contract's covered weights in FP8 blockwise or INT4
    (pack-quantized); returns the quantized names. MXFP8 and NVFP4 have no common checkpoint
    layout yet and are refused."""
    if contract.rollout not in ("fp8_block", "int4"):
        raise ValueError(f"checkpoint conversion writes fp8_block (SGLang's FP8 layout) or int4 "
                         f"(compressed-tensors W4A16); {contract.rollout} has no common checkpoint "
                         "layout yet")
    int4 = contract.rollout == "int4"
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} has no *.safetensors files")
    scales = {} if int4 else _input_scales(files, contract)  # static input scales: FP8's only
    dst.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    kept: list[str] = []  # modules of 2-d weights left unquantized: modules_to_not_convert
    for f in files:
        out: dict[str, torch.Tensor] = {}
        for name, t in load_file(f).items():
            if name.endswith(SCALE_SUFFIX):
                if scales:
                    out[name] = t.float()
                continue
            if contract.tensor_format(name, "rollout") == BF16 or t.dim() != 2:
                out[name] = t
                if t.dim() == 2 and name.endswith(".weight"):
                    kept.append(name.removesuffix(".weight"))
                continue
            q = quantize(t, contract.rollout, "weight", name=name)
            base = name.removesuffix(".weight")
            if int4:
                from milepost.lowprec.checkpoint_weights import pack_quantized

                out.update({base + suffix: v for suffix, v in pack_quantized(q).items()})
            else:
                out[name] = q.values
                out[base + ".weight_scale_inv"] = q.scales  # multiplies back
            done.append(name)
        save_file(out, dst / f.name, metadata={"format": "pt"})
    for other in src.iterdir():  # tokenizer, generation config, index...
        if other.is_file() and other.suffix != ".safetensors" and other.name != "config.json":
            shutil.copy2(other, dst / other.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _int4_config(sorted(kept)) if int4 else {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static" if scales else "dynamic",
        "weight_block_size": [FP8_TILE, FP8_TILE],
        # Module names, as transformers and SGLang match them (prefix / suffix), so a reader
        # that quantizes every other linear leaves these (lm_head, routers, overrides) alone.
        "modules_to_not_convert": sorted(kept) or None,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return done


def _int4_config(kept: list[str]) -> dict[str, object]:
    """compressed-tensors' quantization_config for symmetric W4A16 in groups of 128; `ignore`
    lists the modules left unquantized by name, as compressed-tensors matches them."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": INT4_GROUP, "dynamic": False, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None, "ignore": kept,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}}}


def _input_scales(files: list[Path], contract: Contract) -> dict[str, float]:
    """The source's static input scales, {name: value}: none (dynamic), or one positive scale for
    every FP8 linear, equal within a projection the engines fuse (q/k/v, gate/up); else refused."""
    found: dict[str, float] = {}
    covered: set[str] = set()
    for f in files:
        for name, t in load_file(f).items():
            if name.endswith(SCALE_SUFFIX):
                found[name] = float(t)
            elif contract.tensor_format(name, "rollout") != BF16 and t.dim() == 2:
                covered.add(input_scale_name(name))
    if not found or not any(found.values()):
        return {}  # none, or a trainer export before its first step (zeros: no history yet)
    problems = sorted(covered - set(found))[:3] + [f"{n}={v} (not > 0)" for n, v in found.items()
                                                    if not v > 0][:3]
    groups: dict[str, set[float]] = {}
    for n, v in found.items():
        for part, fused in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"),
                            ("gate_proj", "gate_up"), ("up_proj", "gate_up")):
            if n.endswith(f".{part}{SCALE_SUFFIX}"):
                groups.setdefault(n.rsplit(".", 2)[0] + "." + fused, set()).add(v)
    problems += [f"{g}: unequal input scales {sorted(v)}" for g, v in groups.items() if len(v) > 1]
    if problems:
        raise ValueError("the source's static input scales (*.input_scale) must cover every FP8 "
                         "linear with one positive scale, equal within q/k/v and gate/up: "
                         + "; ".join(problems) + "; export the trainer after a training step, "
                         "or drop the scales for dynamic activation scaling")
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--format", choices=("fp8_block", "int4"), default="fp8_block")
    p.add_argument("--precision-override", action="append", default=[])
    p.add_argument("--precision-bf16-first-layers", type=int, default=0)
    p.add_argument("--precision-bf16-last-layers", type=int, default=0)
    a = p.parse_args(argv)
    by_layer = ()
    if a.precision_bf16_first_layers or a.precision_bf16_last_layers:
        # The trainer's resolution (rules.py): the same ranges from the same config.json.
        n = int(json.loads((a.src / "config.json").read_text())["num_hidden_layers"])
        if max(a.precision_bf16_first_layers, a.precision_bf16_last_layers) > n:
            p.error(f"--precision-bf16-first-layers / --precision-bf16-last-layers: {a.src} has "
                    f"{n} decoder layers; use at most {n}")
        by_layer = layer_overrides(a.precision_bf16_first_layers, a.precision_bf16_last_layers, n)
    contract = Contract(a.format, a.format, by_layer + parse_overrides(a.precision_override))
    names = convert_checkpoint(a.src, a.dst, contract)
    print(f"{len(names)} weights in {a.format} -> {a.dst}")


if __name__ == "__main__":
    main()
