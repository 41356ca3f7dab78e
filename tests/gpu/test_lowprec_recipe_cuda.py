"""Delayed FP8 scaling and NVFP4 stochastic rounding on CUDA: the per-tensor quantizer gives the
CPU's bits, SR draws stay on the grid and unbiased on the device, and the FSDP trainer with
`--fp8-scaling delayed` trains, reduces its amaxes over NCCL (2 ranks where 2 GPUs exist) and
resumes bit for bit. Run on the accelerator machine:
`python -m pytest -q -m gpu tests/gpu/test_lowprec_recipe_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.lowprec.delayed import qdq_per_tensor
from milepost.lowprec.quantize import element_scale, quantize
from milepost.lowprec.stochastic import qdq_nvfp4_stochastic
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import split_for_rank
from milepost.train.checkpoint import checkpoint_path
from milepost.train.fsdp import FSDPBackend, TrainerSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_per_tensor_quantizer_gives_the_cpu_bits() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1024, generator=g) * torch.logspace(-4, 2, 1024)
    scale = x.abs().amax() / 448.0
    cpu = qdq_per_tensor(x, scale)
    cuda = qdq_per_tensor(x.cuda(), scale.cuda()).cpu()
    assert torch.equal(cpu, cuda)


def test_stochastic_rounding_on_the_device_is_unbiased() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8, 64, device="cuda", generator=g)
    draws = 8192
    rows = qdq_nvfp4_stochastic(x.repeat(draws, 1), generator=g).reshape(draws, *x.shape)
    denom = element_scale(quantize(x, "nvfp4", "activation"))
    inside = (x / denom).abs() <= 6.0
    err = (rows.mean(0) - x)[inside]
    rne = (quantize_rne(x) - x)[inside]
    assert err.abs().mean() < rne.abs().mean() / 10


def quantize_rne(x: torch.Tensor) -> torch.Tensor:
    from milepost.lowprec.linear import qdq

    return qdq(x, "nvfp4")


SETTINGS = TrainerSettings(lr=1e-3, global_batch_size=4, max_tokens_per_micro_batch=40,
                           precision="fp8_block", fp8_scaling="delayed", fp8_amax_history_len=4,
                           device="cuda", dtype="bfloat16")


def _worker(rank: int, world: int, model: str, run: str) -> dict:
    def batch(seed: int):
        full = random_train_batch(8, seed)
        return full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))

    def params(b: FSDPBackend) -> dict[str, torch.Tensor]:
        return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in b.policy.named_parameters()}

    a = FSDPBackend.create(model, SETTINGS)
    a.train_step(batch(1))
    a.save_checkpoint(checkpoint_path(run, 1))
    a.train_step(batch(2))
    b = FSDPBackend.create(model, SETTINGS)
    b.load_checkpoint(checkpoint_path(run, 1))
    b.train_step(batch(2))
    pa, pb = params(a), params(b)
    return {"scale": a.fp8_scaling.scale.cpu(), "history": a.fp8_scaling.history.cpu(),
            "bitwise": all(torch.equal(pa[n], pb[n]) for n in pa)}


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_trainer_with_delayed_scaling(tmp_path: Path, world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    model = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False)
    results = run_ranks(_worker, world, str(model), str(tmp_path / "run"), backend="nccl")
    for r in results:
        assert r["bitwise"] and torch.isfinite(r["history"]).all() and (r["history"][:4] > 0).all()
        assert torch.equal(r["scale"], results[0]["scale"])  # one scale on every rank
