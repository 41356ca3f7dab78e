"""Precision controls of the diffusion trainer: deterministic mode and per-parameter dtypes.

Deterministic mode: torch's deterministic algorithms (an op without one raises rather than
silently varying), fixed seeds per step, and the attention backend 'math' (config refuses
others). Per-parameter dtype: with `--trainer-backend fsdp2`, each module whose name contains an
entry of `--fp32-modules` is sharded as its own FSDP2 unit with an FP32 mixed-precision policy,
everything else computes in `--param-dtype`; master weights and gradients' reduction stay FP32.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn


def set_deterministic(seed: int) -> None:
    """Deterministic kernels and seeds for this process (CUDA also needs CUBLAS_WORKSPACE_CONFIG)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(seed)


def _ensure_process_group(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    fd, store = tempfile.mkstemp(prefix="milepost-diffusion-pg-")
    os.close(fd)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{store}",
                            rank=0, world_size=1)


def fp32_module_names(model: nn.Module, patterns: list[str]) -> list[str]:
    """Outermost modules whose dotted name contains one of `patterns` (a name part)."""
    found: list[str] = []
    for name, _ in model.named_modules():
        if name and any(p in name.split(".") for p in patterns) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def apply_precision(model: nn.Module, cfg: object) -> nn.Module:
    """The model as the trainer runs it: as is (plain), or FSDP2-sharded with per-module policies."""
    if getattr(cfg, "deterministic", False):
        set_deterministic(getattr(cfg, "seed", 0))
    if getattr(cfg, "trainer_backend", "plain") != "fsdp2":
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _ensure_process_group(str(getattr(cfg, "device", "cpu")))
    low = getattr(torch, getattr(cfg, "param_dtype", "float32"))
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    # the tiny DiT casts inside its blocks; a diffusers transformer expects inputs in its own dtype
    mixed = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32,
                                 cast_forward_inputs=bool(getattr(model, "fsdp_cast_inputs", False)))
    for name in fp32_module_names(model, list(getattr(cfg, "fp32_modules", []))):
        fully_shard(model.get_submodule(name), mp_policy=fp32)
    for block in model.blocks:  # type: ignore[attr-defined]
        fully_shard(block, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(model, "condition")  # called outside forward (CFG shares it): unshard too
    return model


def gathered_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full tensor}, gathering DTensor shards of an FSDP2 model (one rank: a local view)."""
    out = {}
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach()
    return out
