"""On CUDA: disk offload of the trainer keeps host memory under the staging buffer plus a small
constant while gigabytes move (issue 9), measured as the process's peak resident set (VmRSS) and
torch's pinned host pool. Host offload, which holds the whole state in pinned memory, is the
control that shows the meters see the state when it is in host memory.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_train_cuda_host_memory.py`.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.train.host_memory import peak_rss_growth

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MiB = 1 << 20
STAGING = 16 * MiB
SLACK = 64 * MiB  # CUDA runtime bookkeeping, Python objects, file buffers
# ~170M parameters: fp32 weights + AdamW moments ~ 2 GB (grads are freed after the step)
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)


def local_params(backend: FSDPBackend) -> list[torch.Tensor]:
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for p in backend.policy.parameters()]


def worker(rank: int, world: int, path: str, work: str) -> dict:
    out = {}
    for dest in ("disk", "host"):  # disk first: its staging buffer is a fresh pinned allocation
        s = TrainerSettings(lr=1e-4, global_batch_size=2, max_tokens_per_micro_batch=512, device="cuda",
                            dtype="bfloat16", offload_destination=dest, offload_dir=f"{work}/offload",
                            offload_staging_bytes=STAGING)
        backend = FSDPBackend.create(path, s)
        backend.train_step(random_train_batch(2, seed=1, vocab=30000))  # grads + moments exist now
        torch.cuda.synchronize()
        before = local_params(backend)
        off = peak_rss_growth(backend.offload)
        on = peak_rss_growth(backend.onload)
        out[dest] = {"moved": off.result.bytes,
                     "rss": (off.peak_growth_bytes, on.peak_growth_bytes),
                     "pinned": (off.pinned_peak_growth_bytes, on.pinned_peak_growth_bytes),
                     "exact": all(torch.equal(a, b) for a, b in zip(before, local_params(backend)))}
        del backend
        gc.collect()
        torch.cuda.empty_cache()
    return out


def test_disk_offload_host_memory_is_bounded_by_the_staging_buffer(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False, vocab_size=32768, **SHAPE)
    [r] = run_ranks(worker, 1, str(path), str(tmp_path), backend="nccl", timeout_s=300)
    disk, host = r["disk"], r["host"]
    print(f"moved {disk['moved'] / MiB:.0f} MiB; disk RSS rise {[x / MiB for x in disk['rss']]} MiB, "
          f"pinned {disk['pinned']}; host RSS rise {[x / MiB for x in host['rss']]} MiB, pinned {host['pinned']}")
    assert disk["exact"] and host["exact"]
    assert disk["moved"] > 1500 * MiB  # the bound below is far under the state that moved
    for rise in disk["rss"]:  # offload, then reload
        assert rise <= STAGING + SLACK, f"disk offload raised RSS by {rise / MiB:.1f} MiB"
    for rise in disk["pinned"]:
        assert rise is None or rise <= STAGING, f"disk offload grew the pinned pool by {rise / MiB:.1f} MiB"
    # The control: the host destination's full copy shows in at least one meter.
    seen = max(host["rss"][0], host["pinned"][0] or 0)
    assert seen >= 0.9 * host["moved"], f"host offload of {host['moved'] / MiB:.0f} MiB seen as {seen / MiB:.0f} MiB"
