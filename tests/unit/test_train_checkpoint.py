"""Checkpoints on 2 gloo ranks: bitwise resume, RNG and extra state, atomic saves, latest_checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train import checkpoint as ckpt_module
from milepost.train.batch import TrainBatch, split_for_rank
from milepost.train.checkpoint import META_FILE, checkpoint_path, latest_checkpoint
from milepost.train.fsdp import FSDPBackend, TrainerSettings

SETTINGS = TrainerSettings(
    lr=1e-3,
    lr_warmup_iters=3,  # the schedule position must survive the resume
    lr_decay_style="cosine",
    num_steps_total=10,
    weight_decay=0.01,
    global_batch_size=4,
    max_tokens_per_micro_batch=40,
)


def local_batch(seed: int, rank: int, world: int) -> TrainBatch:
    full = random_train_batch(8, seed)
    return full.select(split_for_rank([t.numel() for t in full.tokens], rank, world, 4))


def params(backend: FSDPBackend) -> dict[str, torch.Tensor]:
    # Each rank's own shard: bitwise equality of every shard is bitwise equality of the model.
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in backend.policy.named_parameters()}


def draws() -> tuple[list[float], float, float]:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def resume_worker(rank: int, world: int, model_path: str, run_dir: str) -> dict:
    a = FSDPBackend.create(model_path, SETTINGS)
    a.train_step(local_batch(1, rank, world))
    draws()  # move the RNG streams away from their seeded start
    a.save_checkpoint(checkpoint_path(run_dir, 1), extra={"step": 1, "data": {"epoch": 0, "offset": 8}})
    draws_a = draws()
    metrics_a = a.train_step(local_batch(2, rank, world))
    params_a = params(a)

    real = ckpt_module._rng_state
    ckpt_module._rng_state = lambda: (_ for _ in ()).throw(OSError("disk full"))  # dies after the DCP write
    try:
        a.save_checkpoint(checkpoint_path(run_dir, 2), extra={"step": 2})
        crashed = False
    except OSError:
        crashed = True
    ckpt_module._rng_state = real
    torch.distributed.barrier()
    after_crash = latest_checkpoint(run_dir)
    leftovers = sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())

    b = FSDPBackend.create(model_path, SETTINGS)
    extra = b.load_checkpoint(after_crash)
    draws_b = draws()
    metrics_b = b.train_step(local_batch(2, rank, world))
    params_b = params(b)
    for _ in range(2):  # a second save over the same path replaces it
        b.save_checkpoint(checkpoint_path(run_dir, 2), extra={"step": 2})
    return {
        "bitwise": all(torch.equal(params_a[n], params_b[n]) for n in params_a),
        "moved": any(not torch.equal(params_a[n], params(FSDPBackend.create(model_path, SETTINGS))[n]) for n in params_a),
        "metrics": (metrics_a, metrics_b),
        "draws": (draws_a, draws_b),
        "extra": extra,
        "crashed": crashed,
        "after_crash": after_crash,
        "leftovers": leftovers,
        "final": latest_checkpoint(run_dir),
    }


def test_resume_is_bitwise_and_saves_are_atomic(tmp_path: Path) -> None:
    model = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False)
    run = tmp_path / "run"
    for r in run_ranks(resume_worker, 2, str(model), str(run)):
        assert r["bitwise"] and r["moved"]
        assert r["metrics"][0] == r["metrics"][1]
        assert r["draws"][0] == r["draws"][1]
        assert r["extra"] == {"step": 1, "data": {"epoch": 0, "offset": 8}}
        assert r["crashed"] and r["after_crash"] == checkpoint_path(run, 1)
        assert r["leftovers"][0] == "step_00000001" and r["leftovers"][1].startswith("step_00000002.tmp-")
        assert r["final"] == checkpoint_path(run, 2)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert {f.name for f in checkpoint_path(run, 2).iterdir()} >= {META_FILE, ".metadata", "rank_0.pt", "rank_1.pt"}


def test_latest_checkpoint_ignores_incomplete(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step, complete in ((3, True), (12, True), (20, False)):
        d = checkpoint_path(tmp_path, step)
        d.mkdir(parents=True)
        if complete:
            (d / META_FILE).write_text("{}")
    (tmp_path / "checkpoints" / "step_00000099.tmp-1").mkdir()
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 12)
