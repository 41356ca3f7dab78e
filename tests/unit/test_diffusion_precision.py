"""Per-parameter dtype through FSDP2 (one CPU rank): modules named in --fp32-modules compute in
FP32, the rest in BF16, master weights stay FP32; deterministic mode repeats a step bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from milepost.diffusion.model import DiTConfig, TinyDiT
from milepost.diffusion.precision import apply_precision, fp32_module_names

torch.set_num_threads(1)


def test_fp32_modules_compute_in_fp32_under_fsdp2() -> None:
    torch.manual_seed(0)
    model = TinyDiT(DiTConfig(dim=16, depth=2, heads=2))
    names = fp32_module_names(model, ["t_embedder", "adaLN_modulation"])
    assert "t_embedder" in names and "blocks.0.adaLN_modulation" in names and "final_layer.adaLN_modulation" in names
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        return lambda mod, args, out: seen.__setitem__(name, mod.weight.dtype)

    model.t_embedder.mlp[0].register_forward_hook(record("t_embedder"))
    model.blocks[0].adaLN_modulation[1].register_forward_hook(record("modulation"))
    model.blocks[0].qkv.register_forward_hook(record("qkv"))
    cfg = SimpleNamespace(trainer_backend="fsdp2", param_dtype="bfloat16", device="cpu",
                          fp32_modules=["t_embedder", "adaLN_modulation"], deterministic=False)
    had_group = dist.is_initialized()
    try:
        model = apply_precision(model, cfg)
        out = model(torch.randn(2, 3, 32, 32), torch.rand(2), torch.tensor([0, 1]))
        out.pow(2).mean().backward()
    finally:  # the one-rank group must not outlive the test (other tests start their own)
        if not had_group and dist.is_initialized():
            dist.destroy_process_group()
    assert seen == {"t_embedder": torch.float32, "modulation": torch.float32, "qkv": torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # sharded master weights
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
