"""Run-config refusals of `--true-on-policy`, checked at start before anything is launched.

The model's profile (architecture, MoE), the device and dtype, fp8 serving, the engine backend
and LoRA go through `profile_refusals`; trainer settings that would leave the contract (compiled
layers fuse the elementwise ops differently) are refused here too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from milepost.onpolicy.profiles import profile_refusals

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def _architecture(checkpoint: Path | str | None) -> tuple[str | None, bool]:
    """(architectures[0] of the checkpoint's config.json, whether it is MoE); (None, False) unread."""
    from milepost.models.support import BY_NAME

    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, TypeError, json.JSONDecodeError):
        return None, False  # reported where the checkpoint is read
    arch = (config.get("architectures") or [None])[0]
    known = BY_NAME.get(arch) if arch else None
    moe = known.moe if known else bool(config.get("num_experts") or config.get("num_local_experts"))
    return arch, moe


def true_on_policy_refusals(c: TrainConfig) -> list[str]:
    if not c.true_on_policy:
        return []
    device = c.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = c.dtype if c.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    arch, moe = _architecture(c.hf_checkpoint)
    p = profile_refusals(arch, moe=moe, device=device, dtype=dtype, quantization=c.engine_quantization,
                         engine_backend=c.engine_backend, lora=bool(c.lora_rank))
    if c.launcher != "local":
        p.append(f"--true-on-policy with --launcher {c.launcher}: only the local launcher pins the "
                 "engines' CPU threads to the trainer's so far; use --launcher local")
    if c.compile_layers:
        p.append("--true-on-policy with --compile-layers: compiled layers fuse the trainer's ops "
                 "differently from the engine's re-score; drop --compile-layers")
    return p
