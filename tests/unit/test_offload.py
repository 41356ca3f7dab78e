"""Evicting the trainer's tensors to host memory or disk and back (issue 9): exact, and freed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.train.offload import StateEvictor, trainer_tensors

CPU = torch.device("cpu")


def setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def step(m: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    opt.zero_grad(set_to_none=False)  # keep the gradient buffers: they must move too
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()


@pytest.mark.parametrize("destination", ["host", "disk"])
def test_evict_frees_and_restore_is_bit_exact(tmp_path: Path, destination: str) -> None:
    plain, plain_opt = setup()
    moved, moved_opt = setup()
    evictor = StateEvictor(destination, CPU, directory=tmp_path, staging_bytes=1000)
    for i in range(4):
        step(plain, plain_opt, i)
        step(moved, moved_opt, i)
        tensors = trainer_tensors([moved], [moved_opt])
        held = sum(t.untyped_storage().nbytes() for t in tensors)
        stats = evictor.evict(tensors)
        assert stats.bytes == held  # weights, grads, moments, step counters: all distinct storages
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        assert (tmp_path / "rank0.bin").exists() == (destination == "disk")
        assert evictor.restore().bytes == held
        assert not (tmp_path / "rank0.bin").exists()
    for a, b in zip(plain.state_dict().values(), moved.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(plain_opt.state.values(), moved_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_views_share_one_copy(tmp_path: Path) -> None:
    base = torch.arange(10, dtype=torch.float32)
    views = [base[:5], base[5:], base]
    evictor = StateEvictor("host", CPU)
    assert evictor.evict(views).bytes == 40
    evictor.restore()
    assert torch.equal(views[1], torch.arange(5, 10, dtype=torch.float32))


def test_an_unwritable_directory_fails_before_anything_is_freed(tmp_path: Path) -> None:
    m, opt = setup()
    step(m, opt, 0)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    (tmp_path / "file").write_text("in the way")
    evictor = StateEvictor("disk", CPU, directory=tmp_path / "file" / "sub")
    with pytest.raises(OSError, match="nothing was offloaded"):
        evictor.evict(trainer_tensors([m], [opt]))
    assert not evictor.evicted
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_bad_settings_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--offload-train-destination"):
        StateEvictor("gpu", CPU)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--offload-train-dir"):
        StateEvictor("disk", CPU)
    evictor = StateEvictor("host", CPU)
    evictor.evict([torch.ones(3)])
    with pytest.raises(RuntimeError, match="restore first"):
        evictor.evict([torch.ones(3)])
