"""Run-config refusals of LoRA RL (report 5.1): what a LoRA run cannot combine with yet.

Disk-delta's refusal lives with the other weight-transport rules (config_rules.py); the checks
that need the model (mixture-of-experts MLPs, non-native architectures) run when the trainer
attaches the adapter (milepost/lora/adapters.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from milepost.lora.settings import parse_target_modules

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
    return p
