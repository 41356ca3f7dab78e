"""Issue 9 on real gloo ranks: streaming the optimizer state and evicting the trainer change
nothing about training (bitwise, fp32 moments), and streamed checkpoints resume exactly."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.batch import split_for_rank
from milepost.train.fsdp import FSDPBackend, TrainerSettings

BASE = dict(lr=1e-3, global_batch_size=4, max_tokens_per_micro_batch=40, use_kl_loss=True,
            kl_loss_coef=0.05, weight_decay=0.01)


def local_params(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in backend.policy.named_parameters()}


def steps(backend: FSDPBackend, rank: int, world: int, seeds: range, offload: bool = False) -> None:
    for seed in seeds:
        full = random_train_batch(8, seed)
        backend.train_step(full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4)))
        if offload:
            stats = backend.offload()
            assert stats.bytes > 0
            assert all(p._local_tensor.untyped_storage().nbytes() == 0
                       for p in backend.policy.parameters())
            backend.onload()


def variants_worker(rank: int, world: int, path: str, tmp: str) -> dict[str, dict]:
    out = {}
    for name, extra, offload in [
        ("plain", {}, False),
        ("streamed", {"optimizer_state_dir": f"{tmp}/opt", "optimizer_bucket_bytes": 4096}, False),
        ("host", {}, True),
        ("disk+streamed", {"optimizer_state_dir": f"{tmp}/opt2", "offload_destination": "disk",
                           "offload_dir": f"{tmp}/off", "offload_staging_bytes": 1000}, True),
    ]:
        backend = FSDPBackend.create(path, TrainerSettings(**BASE, **extra))
        steps(backend, rank, world, range(1, 4), offload)
        out[name] = local_params(backend)
    return out


def both_workers(rank: int, world: int, path: str, tmp: str) -> dict:
    return {"variants": variants_worker(rank, world, path, tmp), **resume_worker(rank, world, path, tmp)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both workers (their files apart under one folder) in one 2-rank run: each rank process
    pays its own start (docs/testing.md, "Suite time")."""
    tmp = tmp_path_factory.mktemp("memory")
    path = make_tiny_checkpoint(tmp / "m", "qwen3", with_tokenizer=False)
    return {"tmp": tmp, "results": run_ranks(both_workers, 2, str(path), str(tmp))}


# One group: the fixture's ranks run once, on the worker that runs these tests.
shared_ranks = pytest.mark.xdist_group("train_memory_ranks")


@shared_ranks
def test_streaming_and_offload_are_bitwise_plain_training(ranks: dict) -> None:
    for r in ranks["results"]:
        plain = r["variants"]["plain"]
        for name in ("streamed", "host", "disk+streamed"):
            assert all(torch.equal(plain[k], r["variants"][name][k]) for k in plain), name


def resume_worker(rank: int, world: int, path: str, tmp: str) -> dict:
    streamed = dict(BASE, optimizer_state_dir=f"{tmp}/live-a", optimizer_bucket_bytes=4096)
    a = FSDPBackend.create(path, TrainerSettings(**streamed))
    steps(a, rank, world, range(1, 3))
    a.save_checkpoint(f"{tmp}/ckpt", extra={"step": 1})
    steps(a, rank, world, range(3, 5))
    b = FSDPBackend.create(path, TrainerSettings(**dict(streamed, optimizer_state_dir=f"{tmp}/live-b")))
    b.load_checkpoint(f"{tmp}/ckpt")
    steps(b, rank, world, range(3, 5))
    refusals = []
    plain = FSDPBackend.create(path, TrainerSettings(**BASE))
    try:
        plain.load_checkpoint(f"{tmp}/ckpt")
    except ValueError as e:
        refusals.append(str(e))
    plain.save_checkpoint(f"{tmp}/plain-ckpt", extra={"step": 0})
    c = FSDPBackend.create(path, TrainerSettings(**dict(streamed, optimizer_state_dir=f"{tmp}/live-c")))
    try:
        c.load_checkpoint(f"{tmp}/plain-ckpt")
    except ValueError as e:
        refusals.append(str(e))
    return {"a": local_params(a), "b": local_params(b), "refusals": refusals}


@shared_ranks
def test_streamed_checkpoint_resumes_exactly_and_mixing_is_refused(ranks: dict) -> None:
    tmp_path = ranks["tmp"]
    for r in ranks["results"]:
        assert all(torch.equal(r["a"][k], r["b"][k]) for k in r["a"])
        without, into = r["refusals"]
        assert "resume it with that setting" in without
        assert "written without streaming" in into
    assert sorted(p.name for p in (tmp_path / "ckpt" / "optimizer_stream").iterdir()) == ["rank_0", "rank_1"]


def test_disk_offload_needs_a_directory() -> None:
    with pytest.raises(ValueError, match="offload_dir"):
        TrainerSettings(offload_destination="disk")
