"""Streaming the Adam moments from disk (issue 9): bitwise the same as torch's AdamW."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.train.optim_stream import StreamingAdamW, plan_buckets

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    m.frozen = torch.nn.Parameter(torch.randn(5))  # never gets a gradient
    return m


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()


def test_plan_cuts_at_the_byte_budget_and_keeps_large_params_whole() -> None:
    buckets = plan_buckets([10, 10, 100, 5], element_size=4, bucket_bytes=200)
    assert [b.params for b in buckets] == [(0, 1), (2,), (3,)]
    assert [b.numel for b in buckets] == [20, 100, 5]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([1], 4, 0)


@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])  # many buckets / one
def test_fp32_moments_are_bitwise_torch_adamw(tmp_path: Path, bucket_bytes: int) -> None:
    ref, streamed = model(), model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    opt = StreamingAdamW(streamed.parameters(), tmp_path, bucket_bytes=bucket_bytes, **HYPER)
    assert (len(opt.buckets) > 3) == (bucket_bytes == 256)
    train(ref, ref_opt, range(6))
    train(streamed, opt, range(6))
    for a, b in zip(ref.parameters(), streamed.parameters()):
        assert torch.equal(a, b)
    # The moments on disk are torch's moments.
    names = [n for n, _ in streamed.named_parameters()]
    i = names.index("0.weight")
    b = next(b for b in opt.buckets if i in b.params)
    exp_avg, exp_avg_sq = opt._load(b, torch.device("cpu"))
    state = ref_opt.state[ref[0].weight]
    assert torch.equal(exp_avg[b.params.index(i)], state["exp_avg"])
    assert torch.equal(exp_avg_sq[b.params.index(i)], state["exp_avg_sq"])
    assert set(opt.state[streamed[0].weight]) == {"step"}  # moments are not held in memory


def test_bf16_moments_stay_close(tmp_path: Path) -> None:
    ref, streamed = model(), model()
    train(ref, torch.optim.AdamW(ref.parameters(), **HYPER), range(6))
    opt = StreamingAdamW(streamed.parameters(), tmp_path, moment_dtype=torch.bfloat16, **HYPER)
    train(streamed, opt, range(6))
    assert sum(f.stat().st_size for f in tmp_path.glob("bucket_*.bin")) == 2 * 2 * sum(
        p.numel() for p in streamed.parameters())
    for a, b in zip(ref.parameters(), streamed.parameters()):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=0)


def test_checkpoint_files_resume_exactly(tmp_path: Path) -> None:
    straight = model()
    opt = StreamingAdamW(straight.parameters(), tmp_path / "live-a", bucket_bytes=512, **HYPER)
    train(straight, opt, range(3))
    opt.save_files(tmp_path / "ckpt")
    saved = {k: v.clone() for k, v in straight.state_dict().items()}
    train(straight, opt, range(3, 6))

    resumed = model(seed=1)
    resumed.load_state_dict(saved)
    opt2 = StreamingAdamW(resumed.parameters(), tmp_path / "live-b", bucket_bytes=512, **HYPER)
    opt2.load_files(tmp_path / "ckpt")
    train(resumed, opt2, range(3, 6))
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_resume_refuses_another_layout_or_a_checkpoint_without_streaming(tmp_path: Path) -> None:
    m = model()
    opt = StreamingAdamW(m.parameters(), tmp_path / "live", bucket_bytes=512, **HYPER)
    train(m, opt, range(1))
    opt.save_files(tmp_path / "ckpt")
    other = StreamingAdamW(model().parameters(), tmp_path / "live2", bucket_bytes=1 << 20, **HYPER)
    with pytest.raises(ValueError, match="another parallel layout"):
        other.load_files(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="written without streaming"):
        other.load_files(tmp_path / "empty")
    (tmp_path / "ckpt" / "bucket_00000.bin").write_bytes(b"\0" * 8)
    again = StreamingAdamW(model().parameters(), tmp_path / "live3", bucket_bytes=512, **HYPER)
    with pytest.raises(RuntimeError, match="damaged"):
        again.load_files(tmp_path / "ckpt")


def test_an_unwritable_directory_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        StreamingAdamW(model().parameters(), blocker / "sub", **HYPER)
