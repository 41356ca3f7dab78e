"""The FSDP2 backend's weights for the engines and its exports: full tensors gathered from the
shards (a collective on every rank), named as the engines load them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from milepost.lora.adapters import adapter_parameters
from milepost.lora.multi_train import AdapterSteps
from milepost.lora.peft_format import write_peft_adapter
from milepost.lora.settings import ADAPTER_SEP, POLICY_ADAPTER, LoraSettings
from milepost.train.settings import TrainerSettings


def hf_weights(lm: nn.Module, settings: TrainerSettings,
               adapter_steps: AdapterSteps | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor in the compute dtype): HF names for the whole model; with LoRA, only the adapter
    ("policy/...q_proj.lora_A.weight"); with multi-LoRA, the adapters stepped since the last call
    ("<adapter>/...")."""
    dtype = settings.torch_dtype
    if adapter_steps is not None:
        params = adapter_steps.engine_params(adapter_steps.take_pending())
    elif settings.lora is not None:
        params = ((f"{POLICY_ADAPTER}{ADAPTER_SEP}{n}", p) for n, p in adapter_parameters(lm))
    else:
        params = lm.named_parameters()
    with torch.no_grad():
        for name, param in params:
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            local = param.to_local() if isinstance(param, DTensor) else param
            if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                full = full.clone()  # never hand out the live parameter: training would change it
            if settings.lora is not None:
                yield name, full.to(dtype)
                continue
            yield from lm.hf_tensors(name, full.to(dtype))


def export_adapters(lm: nn.Module, lora: LoraSettings, adapter_steps: AdapterSteps | None,
                    base_path: Path, path: str | Path, rank: int) -> None:
    """PEFT adapter directories for the base (collective; rank 0 writes): PATH itself for one
    adapter, PATH/<adapter> for each of a multi-LoRA run's."""
    if adapter_steps is not None:
        adapter_steps.export(path, lora, base_path, rank == 0)
    else:
        with torch.no_grad():  # fp32 masters, gathered on every rank (a collective), written by rank 0
            named = [(n, p.full_tensor() if isinstance(p, DTensor) else p.detach())
                     for n, p in adapter_parameters(lm)]
        if rank == 0:
            write_peft_adapter(named, lora, base_path, path)
    dist.barrier()
