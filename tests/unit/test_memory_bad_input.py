"""Issue 9's bad input: a full disk (writes to /dev/full fail with ENOSPC, as on a full disk) or an
unwritable directory is a clear error with the trainer state intact; a resume with missing or
mismatched streamed optimizer files is refused with a message."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.train.offload import StateEvictor
from milepost.train.optim_stream import StreamingAdamW

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def full_disk_at(path: Path) -> None:
    """Make writes to `path` fail with ENOSPC, as on a full disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/dev/full")


def test_offload_to_a_full_disk_raises_with_the_state_intact(tmp_path: Path) -> None:
    tensors = [torch.arange(1000, dtype=torch.float32) * i for i in range(3)]
    before = [t.clone() for t in tensors]
    evictor = StateEvictor("disk", torch.device("cpu"), directory=tmp_path, staging_bytes=512)
    full_disk_at(evictor.file())
    with pytest.raises(OSError, match="nothing was offloaded") as err:
        evictor.evict(tensors)
    assert err.value.__cause__.errno == errno.ENOSPC
    assert "--offload-train-dir" in str(err.value)
    assert not evictor.evicted
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def step(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    torch.nn.functional.mse_loss(m(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)).backward()
    opt.step()


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 64])  # one bucket / the failing one mid-step
def test_streamed_moments_on_a_full_disk_keep_the_previous_files(tmp_path: Path, bucket_bytes: int) -> None:
    m = torch.nn.Linear(16, 4)
    opt = StreamingAdamW(m.parameters(), tmp_path / "opt", bucket_bytes=bucket_bytes, **HYPER)
    assert (len(opt.buckets) > 1) == (bucket_bytes == 64)
    step(m, opt, 0)
    bucket = opt._file(opt.buckets[0])
    saved = bucket.read_bytes()
    full_disk_at(bucket.with_suffix(".tmp"))
    with pytest.raises(OSError, match="--stream-optimizer-state-to-disk: cannot write") as err:
        step(m, opt, 1)
    assert err.value.__cause__.errno == errno.ENOSPC
    assert bucket.read_bytes() == saved  # written through a temporary name: the moments survive


def test_streaming_into_an_unwritable_directory_names_the_setting(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(OSError, match="--optimizer-state-dir"):
        StreamingAdamW(torch.nn.Linear(2, 2).parameters(), tmp_path / "file" / "sub", **HYPER)


def test_missing_stream_files_are_refused(tmp_path: Path) -> None:
    m = torch.nn.Linear(16, 4)
    opt = StreamingAdamW(m.parameters(), tmp_path / "live", bucket_bytes=64, **HYPER)
    step(m, opt, 0)
    opt.save_files(tmp_path / "ckpt")
    assert len(opt.buckets) > 1
    (tmp_path / "ckpt" / "bucket_00001.bin").unlink()
    other = StreamingAdamW(torch.nn.Linear(16, 4).parameters(), tmp_path / "live2", bucket_bytes=64, **HYPER)
    with pytest.raises(ValueError, match="bucket_00001.bin is missing from the checkpoint"):
        other.load_files(tmp_path / "ckpt")
    opt._file(opt.buckets[0]).unlink()  # the live state removed under a running trainer
    with pytest.raises(RuntimeError, match="resume from the last checkpoint"):
        step(m, opt, 1)


BASE = dict(lr=1e-3, global_batch_size=4, max_tokens_per_micro_batch=40, critic_lr=1e-2)


def local(module: torch.nn.Module) -> list[torch.Tensor]:
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone() for p in module.parameters()]


def full_disk_worker(rank: int, world: int, path: str, tmp: str) -> dict:
    backend = FSDPBackend.create(path, TrainerSettings(**BASE, offload_destination="disk", offload_dir=tmp))
    full = random_train_batch(4, 1)
    batch = full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))
    backend.train_step(batch)
    before = local(backend.policy) + local(backend.critic.model)
    full_disk_at(backend.residency.evictor.file("critic"))  # the actor fits, the critic does not
    try:
        backend.offload()
        error = ""
    except OSError as e:
        error = str(e)
    after = local(backend.policy) + local(backend.critic.model)  # the actor came back
    metrics = backend.train_step(batch)  # and the trainer goes on
    return {"error": error, "intact": all(torch.equal(a, b) for a, b in zip(before, after)),
            "loss": metrics["loss"], "files": sorted(os.listdir(tmp))}


def one_rank_workers(rank: int, world: int, path: str, tmp: str) -> dict:
    # load_worker reads the checkpoint the 2-rank save_worker wrote before this process started
    return {"full_disk": full_disk_worker(rank, world, path, f"{tmp}/off"), "load": load_worker(rank, world, path, tmp)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The 2-rank save, then both 1-rank workers in one process (3 rank processes where there
    were 4: each pays its own start; docs/testing.md)."""
    tmp = tmp_path_factory.mktemp("bad_input")
    path = make_tiny_checkpoint(tmp / "m", "qwen3", with_tokenizer=False)
    run_ranks(save_worker, 2, str(path), str(tmp))
    return run_ranks(one_rank_workers, 1, str(path), str(tmp))[0]


# One group: the fixture's ranks run once, on the worker that runs these tests.
shared_ranks = pytest.mark.xdist_group("memory_bad_input_ranks")


@shared_ranks
def test_a_full_disk_at_the_critic_brings_the_actor_back(ranks: dict) -> None:
    r = ranks["full_disk"]
    assert "nothing was offloaded" in r["error"] and "rank0-critic.bin" in r["error"]
    assert r["intact"] and r["loss"] == r["loss"]
    assert r["files"] == []  # the actor's file was read back and removed, the partial one too


def save_worker(rank: int, world: int, path: str, tmp: str) -> None:
    backend = FSDPBackend.create(path, TrainerSettings(lr=1e-3, global_batch_size=2,
                                                       optimizer_state_dir=f"{tmp}/live"))
    backend.save_checkpoint(f"{tmp}/ckpt", extra={"step": 0})


def load_worker(rank: int, world: int, path: str, tmp: str) -> str:
    backend = FSDPBackend.create(path, TrainerSettings(lr=1e-3, global_batch_size=2,
                                                       optimizer_state_dir=f"{tmp}/live-1"))
    try:
        backend.load_checkpoint(f"{tmp}/ckpt")
    except ValueError as e:
        return str(e)
    return ""


@shared_ranks
def test_a_streamed_checkpoint_on_another_number_of_ranks_is_refused(ranks: dict) -> None:
    message = ranks["load"]
    assert "resumes only on the same layout" in message and "2 trainer ranks" in message
