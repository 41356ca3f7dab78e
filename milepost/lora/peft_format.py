"""PEFT's adapter directory: `adapter_config.json` + `adapter_model.safetensors`, written and read.

Tensor keys are PEFT's: `base_model.model.` + our parameter name, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (A: [r, in], B: [out, r]), so
`peft.PeftModel.from_pretrained(hf_base, dir)` loads what the trainer exports and the engine
loads what peft saves. Only what milepost trains is read: plain LoRA, no DoRA/rsLoRA/bias/patterns.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from milepost.lora.adapters import is_adapter_name
from milepost.lora.settings import LoraSettings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Keys whose non-default value changes the math: refused on load rather than silently ignored.
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False,
                "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}


def adapter_config(settings: LoraSettings, base_model: str | Path) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "target_modules": list(settings.target_modules),
        "lora_dropout": 0.0,
        "inference_mode": True,
        "init_lora_weights": True,
        **_UNSUPPORTED,
    }


def write_peft_adapter(named: Iterable[tuple[str, torch.Tensor]], settings: LoraSettings,
                       base_model: str | Path, out_dir: str | Path) -> None:
    """Write `named` adapter tensors (our names) as a PEFT directory, atomically (tmp dir + rename)."""
    out = Path(out_dir).absolute()
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {PEFT_PREFIX + n: t.detach().to("cpu", torch.float32, copy=True).contiguous() for n, t in named}
    if not tensors:
        raise ValueError("write_peft_adapter: no adapter tensors to write")
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(settings, base_model), indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def read_peft_adapter(path: str | Path) -> tuple[LoraSettings, dict[str, torch.Tensor]]:
    """(settings, {our name: tensor}) of a PEFT LoRA directory; ValueError naming what is wrong."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a PEFT LoRA adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except ValueError as e:
        raise ValueError(f"{path}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: {CONFIG_FILE} holds {type(config).__name__}, not PEFT's JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, only LORA adapters are served")
    for key, default in _UNSUPPORTED.items():
        value = config.get(key, default)
        if value not in (default, None, {}):
            raise ValueError(f"{path}: {CONFIG_FILE} sets {key}={config[key]!r}; only plain LoRA "
                             f"({key}={default!r}) is supported")
    missing = [k for k in ("r", "lora_alpha") if k not in config]
    if missing:
        raise ValueError(f"{path}: {CONFIG_FILE} has no {missing} (PEFT writes r and lora_alpha)")
    r, alpha, targets = config["r"], config["lora_alpha"], config.get("target_modules") or ()
    try:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"lora_alpha {alpha!r} is not a number")
        settings = LoraSettings(r, float(alpha), targets)  # refuses a rank that is not an int > 0
    except ValueError as e:  # e.g. target_modules naming lm_head, which no engine adapts
        raise ValueError(f"{path}: {CONFIG_FILE} (r={r!r}, lora_alpha={alpha!r}, "
                         f"target_modules={targets!r}): {e}") from None
    try:
        stored = load_file(str(path / WEIGHTS_FILE))
    except SafetensorError as e:
        raise ValueError(f"{path}: {WEIGHTS_FILE} is not a readable safetensors file ({e})") from None
    tensors = {}
    for key, t in stored.items():
        name = key.removeprefix(PEFT_PREFIX).replace(".default.", ".")
        if not is_adapter_name(name):
            raise ValueError(f"{path}: tensor {key!r} is not a LoRA A/B matrix")
        tensors[name] = t
    return settings, tensors
