"""The FSDP2 trainer on CUDA (NCCL): offload/onload is exact and frees the GPU, bf16 compute, resume.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_train_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.models.registry import load_model
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def settings(dtype: str) -> TrainerSettings:
    return TrainerSettings(
        lr=1e-3, global_batch_size=4, max_tokens_per_micro_batch=48, device="cuda", dtype=dtype,
        use_kl_loss=True, kl_loss_coef=0.05,
    )


def params(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu() for n, p in backend.policy.named_parameters()}


def trainer_state_bytes(backend: FSDPBackend, device: str) -> int:
    """Bytes of the trainer's own tensors (policy, reference, grads, optimizer state) on `device`.

    The test compares the memory freed by offload with these, not with all allocated memory: on
    a tiny model the libraries' workspaces (cuBLAS: 64 MiB on the H200) dwarf the model.
    """
    tensors = [p for m in (backend.policy, backend.reference) if m is not None for p in m.parameters()]
    tensors += [p.grad for p in tensors if p.grad is not None]
    tensors += [v for st in backend.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    local = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
    # Storage bytes, not numel: an evicted tensor keeps its shape over a zero-byte storage.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in local if t.device.type == device}
    return sum(storages.values())


def worker(rank: int, world: int, path: str, dtype: str, offload: bool, out: str) -> dict:
    backend = FSDPBackend.create(path, settings(dtype))
    metrics, memory = [], []
    for seed in (1, 2, 3):
        full = random_train_batch(8, seed)
        metrics.append(backend.train_step(full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))))
        if offload:
            torch.cuda.synchronize()
            before, held = torch.cuda.memory_allocated(), trainer_state_bytes(backend, "cuda")
            backend.offload()
            torch.cuda.synchronize()
            memory.append((before - torch.cuda.memory_allocated(), held,
                           trainer_state_bytes(backend, "cuda")))
            backend.onload()
    hf = dict(backend.named_hf_weights())
    ckpt = Path(out) / f"ckpt-{dtype}-{offload}"
    backend.save_checkpoint(ckpt, extra={"step": 3})
    full = random_train_batch(8, 4)
    local = full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))
    m_a = backend.train_step(local)
    p_a = params(backend)
    backend.load_checkpoint(ckpt)
    m_b = backend.train_step(local)
    backend.export_hf(Path(out) / f"export-{dtype}-{offload}")
    return {
        "metrics": metrics,
        "memory": memory,
        "params": params(backend),
        "hf_dtypes": {t.dtype for t in hf.values()},
        "hf_devices": {t.device.type for t in hf.values()},
        "resume_bitwise": all(torch.equal(p_a[n], v) for n, v in params(backend).items()) and m_a == m_b,
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_is_exact_and_frees_memory(tmp_path: Path, dtype: str) -> None:
    path = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    world = min(torch.cuda.device_count(), 2)
    plain = run_ranks(worker, world, str(path), dtype, False, str(tmp_path), backend="nccl")
    moved = run_ranks(worker, world, str(path), dtype, True, str(tmp_path), backend="nccl")
    for a, b in zip(plain, moved):
        assert a["metrics"] == b["metrics"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        for freed, held, left in b["memory"]:
            assert held > 0 and left == 0, (held, left)  # everything the trainer owns moved
            assert freed >= held, (freed, held)  # ... and its GPU memory went with it
        assert a["hf_dtypes"] == {getattr(torch, dtype)} and a["hf_devices"] == {"cuda"}
        assert a["resume_bitwise"] and b["resume_bitwise"]
        # the reference model took part: the policy moved away from it (k1, the default, is a
        # signed estimate, so only its being non-zero says so)
        assert a["metrics"][-1]["kl"] != 0
    exported = load_model(tmp_path / f"export-{dtype}-True", getattr(torch, dtype), "cpu")
    assert exported.weight_view("model.embed_tokens.weight").dtype == getattr(torch, dtype)
