"""PEFT's adapter directory: `adapter_config.json` + `adapter_model.safetensors`, written and read.

Tensor keys are PEFT's: `base_model.model.` + our parameter name, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (A: [r, in], B: [out, r]), so
`peft.PeftModel.from_pretrained(hf_base, dir)` loads what the trainer exports and the engine
loads what peft saves. Only what milepost trains is read: plain LoRA, no DoRA/rsLoRA/bias/patterns.
Adapters on mixture-of-experts experts use peft's `target_parameters` (transformers 5 keeps experts
as stacked `mlp.experts.gate_up_proj` / `down_proj` parameters): peft wraps both in nested
ParamWrappers, gate_up_proj inside (`...mlp.experts.base_layer.lora_A.weight`) and down_proj outside
(`...mlp.experts.lora_A.weight`), A [E*r, in] and B [out, r*E] (milepost/lora/experts.py converts).
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
from milepost.lora.experts import (
    EXPERT_MODULES,
    PEFT_EXPERTS,
    from_peft_layout,
    is_expert_adapter,
    to_peft_layout,
)
from milepost.lora.settings import ATTENTION_MODULES, LoraSettings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Keys whose non-default value changes the math: refused on load rather than silently ignored.
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "bias": "none", "fan_in_fan_out": False,
                "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None}


def adapter_config(settings: LoraSettings, base_model: str | Path, experts: tuple[str, ...] = ()) -> dict:
    """experts: the stacked expert parameters adapted ('gate_up_proj', 'down_proj'); then the MLP
    targets are peft's `target_parameters` (a MoE model's MLPs are its experts: see experts.py)."""
    modules = [m for m in settings.target_modules if not experts or m in ATTENTION_MODULES]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "target_modules": modules,
        **({"target_parameters": [PEFT_EXPERTS + p for p in experts]} if experts else {}),
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
    named = [(n, t.detach().to("cpu", torch.float32, copy=True)) for n, t in named]
    if not named:
        raise ValueError("write_peft_adapter: no adapter tensors to write")
    experts = tuple(p for p in EXPERT_MODULES if any(f".mlp.experts.{p}.lora_" in n for n, _ in named))
    tensors = {PEFT_PREFIX + _peft_name(n, experts): (to_peft_layout(n, t) if is_expert_adapter(n) else t).contiguous()
               for n, t in named}
    save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(settings, base_model, experts), indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _peft_name(name: str, experts: tuple[str, ...]) -> str:
    """Ours -> peft's key: 'model.layers.0.mlp.experts.gate_up_proj.lora_A.weight' becomes
    '...mlp.experts.base_layer.lora_A.weight' beside down_proj (the inner wrapper), else drops the
    parameter's name ('...mlp.experts.lora_A.weight'); other names are peft's already."""
    for param in EXPERT_MODULES:
        head, sep, tail = name.partition(f".mlp.experts.{param}.")
        if sep:
            inner = param == "gate_up_proj" and len(experts) == 2
            return f"{head}.mlp.experts.{'base_layer.' if inner else ''}{tail}"
    return name


def _our_name(key: str, experts: tuple[str, ...]) -> str:
    """The inverse of `_peft_name` for a key without PEFT_PREFIX and adapter name."""
    for wrapper, param in ((".mlp.experts.base_layer.", "gate_up_proj"),
                           (".mlp.experts.", "down_proj" if len(experts) == 2 else experts[0] if experts else "")):
        head, sep, tail = key.partition(wrapper)
        if sep and param and tail.startswith("lora_"):
            return f"{head}.mlp.experts.{param}.{tail}"
    return key


def _expert_params(config: dict, path: Path) -> tuple[str, ...]:
    """peft's target_parameters of an adapter on experts -> ('gate_up_proj', 'down_proj') in that order."""
    given = [str(t) for t in config.get("target_parameters") or []]
    ok = [t for t in given for p in EXPERT_MODULES if t == p or t.endswith(f".experts.{p}")]
    if len(ok) != len(given):
        raise ValueError(f"{path}: {CONFIG_FILE} target_parameters {given!r}: only mixture-of-experts experts "
                         f"({[PEFT_EXPERTS + p for p in EXPERT_MODULES]}) are served")
    return tuple(p for p in EXPERT_MODULES if any(t.rsplit(".", 1)[-1] == p for t in given))


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
    experts = _expert_params(config, path)
    if experts:  # our target names cover the experts' projections (milepost/lora/experts.py)
        targets = list(targets) + [m for p in experts for m in EXPERT_MODULES[p]]
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
        name = _our_name(key.removeprefix(PEFT_PREFIX).replace(".default.", "."), experts)
        if not is_adapter_name(name):
            raise ValueError(f"{path}: tensor {key!r} is not a LoRA A/B matrix")
        if is_expert_adapter(name):
            try:
                t = from_peft_layout(name, t, settings.rank)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
        tensors[name] = t
    return settings, tensors
