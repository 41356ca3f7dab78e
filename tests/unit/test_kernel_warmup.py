"""engine.kernel_warmup: one prefill step of each size, through the real engine thread, then
nothing left of it (cache flushed, counters reset); skipped on CPU by the public entry point;
start_engine freezes the start-up heap."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from milepost.engine.kernel_warmup import (
    _generate_one,
    run_warmup_steps,
    start_engine,
    warm_up_kernels,
    warmup_sizes,
)
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint


def test_sizes_reach_every_power_of_two_bucket_and_an_odd_count() -> None:
    assert warmup_sizes(512) == [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512]
    assert warmup_sizes(100) == [1, 2, 3, 4, 8, 16, 32, 64, 100]
    assert warmup_sizes(1) == [1]
    sizes = warmup_sizes(8192)  # each MoE tile bucket's largest count (a power of two) is run
    assert all(1 << (n - 1).bit_length() in sizes for n in range(1, 8193))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("warm") / "m", "qwen3", seed=2,
                                with_tokenizer=False)


def test_warmup_steps_run_each_size_once_and_leave_nothing_behind(ckpt: Path) -> None:
    args = ServerArgs(model_path=ckpt, device="cpu", dtype="float32", page_size=4,
                      chunked_prefill_size=48, cpu_kv_cache_gb=0.01).resolved()
    engine = build_engine(args)[0]
    gc.unfreeze()
    start_engine(engine)  # the start-up heap leaves the full collections
    try:
        assert gc.get_freeze_count() > 10_000
        assert warm_up_kernels(engine) == 0.0  # CPU: nothing compiles, nothing runs
        assert engine.stats.steps == 0
        steps: list = []
        engine.stats.timeline = steps
        assert run_warmup_steps(engine, timeout_s=120) > 0
        assert [s.tokens for s in steps] == warmup_sizes(48) == [1, 2, 3, 4, 8, 16, 32, 48]
        assert engine.stats.steps == 0 and engine.stats.prompt_tokens == 0  # counters reset
        assert engine.stats.timeline is steps  # a bench's timeline stays attached
        assert engine.pool.num_free == engine.cfg.num_blocks  # the prefix cache was flushed
        _generate_one(engine, "after", [5, 6, 7], timeout_s=60)  # and it serves as before
        assert engine.stats.prompt_tokens == 3
    finally:
        gc.unfreeze()
        engine.close()
