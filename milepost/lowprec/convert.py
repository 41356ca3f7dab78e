"""Checkpoint conversion, the contract's fourth stage: a Hugging Face checkpoint to FP8 blockwise
in the layout SGLang and DeepSeek-V3 checkpoints use (`weight` float8_e4m3fn, `weight_scale_inv`
float32 per 128 x 128 tile, `quantization_config` in config.json), quantized by the same
function the trainer and the engines call.

    python -m milepost.lowprec.convert SRC_DIR DST_DIR [--precision-override layers.0-0=bf16 ...]
        [--precision-bf16-first-layers N] [--precision-bf16-last-layers M]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from milepost.lowprec.contract import BF16, Contract, layer_overrides, parse_overrides
from milepost.lowprec.quantize import FP8_TILE, quantize


def convert_checkpoint(src: Path, dst: Path, contract: Contract) -> list[str]:
    """Write `dst` from `src` with the contract's covered weights in FP8 blockwise; returns the
    quantized names. Other formats have no common checkpoint layout yet and are refused."""
    if contract.rollout != "fp8_block":
        raise ValueError(f"checkpoint conversion writes fp8_block (SGLang's FP8 layout); "
                         f"{contract.rollout} has no common checkpoint layout yet")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} has no *.safetensors files")
    dst.mkdir(parents=True, exist_ok=True)
    done: list[str] = []
    for f in files:
        out: dict[str, torch.Tensor] = {}
        for name, t in load_file(f).items():
            if contract.tensor_format(name, "rollout") == BF16 or t.dim() != 2:
                out[name] = t
                continue
            q = quantize(t, "fp8_block", "weight", name=name)
            out[name] = q.values
            out[name.removesuffix(".weight") + ".weight_scale_inv"] = q.scales  # multiplies back
            done.append(name)
        save_file(out, dst / f.name, metadata={"format": "pt"})
    for other in src.iterdir():  # tokenizer, generation config, index...
        if other.is_file() and other.suffix != ".safetensors" and other.name != "config.json":
            shutil.copy2(other, dst / other.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [FP8_TILE, FP8_TILE],
        "modules_to_not_convert": sorted({p for p, f in contract.overrides if f == BF16}) or None,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return done


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
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
    contract = Contract("fp8_block", "fp8_block", by_layer + parse_overrides(a.precision_override))
    names = convert_checkpoint(a.src, a.dst, contract)
    print(f"{len(names)} weights in fp8_block -> {a.dst}")


if __name__ == "__main__":
    main()
