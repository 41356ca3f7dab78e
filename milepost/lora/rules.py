"""Run-config refusals of LoRA RL (report 5.1): what a LoRA run cannot combine with yet.

Disk-delta's refusal lives with the other weight-transport rules (config_rules.py); the checks
that need the model (mixture-of-experts MLPs, non-native architectures) run in the launcher's
preflight (`check_lora_model`, before any process starts) and again when the trainer attaches the
adapter (milepost/lora/adapters.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from milepost.lora.settings import LoraSettings, parse_target_modules

if TYPE_CHECKING:
    from milepost.config import TrainConfig


def lora_refusals(c: TrainConfig) -> list[str]:
    if not c.lora_rank:
        return []
    p: list[str] = []
    try:
        parse_target_modules(c.lora_target_modules)
    except ValueError as e:
        p.append(str(e))
    if c.update_weight_transfer_mode == "p2p":
        p.append("--update-weight-transfer-mode p2p does not carry LoRA adapters (it writes into "
                 "the engines' base weights); use broadcast (or tensor when colocated) with --lora-rank")
    if c.engine_backend == "sglang":
        p.append("--lora-rank with --engine-backend sglang: adapter weight updates use milepost's "
                 "engine endpoints; use --engine-backend embedded")
    if c.engine_quantization:
        p.append(f"--lora-rank with --engine-quantization {c.engine_quantization}: adapters on a "
                 "quantized base are not served yet; drop --engine-quantization")
    if c.rollout_only:
        p.append("--lora-rank with --rollout-only: there is no trainer to create the adapter; drop one")
    if c.fully_async:
        p.append("--lora-rank with --fully-async is not supported yet: drop --fully-async")
    if c.use_session_server or c.agent_function_path or c.rollout_function_path \
            or c.custom_generate_function_path:
        p.append("--lora-rank with custom rollout layers or the session server is not supported "
                 "yet (their requests do not name the adapter): use the default rollout")
    if not p and (Path(c.hf_checkpoint) / "config.json").is_file():
        try:
            check_lora_model(c.hf_checkpoint, LoraSettings(c.lora_rank, c.lora_alpha, c.lora_target_modules))
        except (ValueError, OSError) as e:
            p.append(str(e))
    return p


def check_lora_model(hf_checkpoint: str | Path, settings: LoraSettings) -> None:
    """Before any process starts: the adapter attaches to this checkpoint's native model (built
    on the meta device, nothing allocated). ValueError naming the layer and module otherwise:
    mixture-of-experts MLPs (experts get no adapters yet), architectures that run through the
    transformers fallback."""
    from milepost.lora.adapters import attach_lora
    from milepost.models.registry import checkpoint_config, model_class, native_reason

    config = checkpoint_config(hf_checkpoint)
    if not getattr(config, "architectures", None):
        return  # an unnamed architecture: the trainer decides when it loads the model
    reason = native_reason(config)
    if reason is not None:
        raise ValueError(f"--lora-rank: {hf_checkpoint} has no native model definition ({reason}); "
                         "LoRA trains and serves adapters on native models only (milepost/models/), "
                         "so train this one without --lora-rank")
    with torch.device("meta"):
        lm = model_class(config)(config)
    attach_lora(lm, settings)
