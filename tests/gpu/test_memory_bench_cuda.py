"""On CUDA: memory release/resume really frees device memory and brings the same model back
(through decode CUDA graphs captured again); `milepost bench engine` runs and reports a bound.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_memory_bench_cuda.py`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from milepost.engine.memory import MemoryOccupation
from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

POOL_TOKENS = 1 << 20  # tiny Qwen3 in bf16: 256 B/token -> 256 MiB of KV


def _greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    left = [len(prompts)]
    done = threading.Event()

    def collect(i: int):
        def on_output(o) -> None:
            out[i].extend(o.new_token_ids)
            if o.finished:
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return on_output

    for i, ids in enumerate(prompts):
        engine.submit(Request(rid=f"r{i}-{len(out[i])}", prompt_ids=ids, on_output=collect(i),
                              params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True),
                              stop_ids=frozenset()))
    assert done.wait(120)
    return [out[i] for i in range(len(prompts))]


def test_release_frees_device_memory_and_resume_restores_the_model(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, "qwen3", with_tokenizer=False)
    args = ServerArgs(model_path=tmp_path, device="cuda", dtype="bfloat16",
                      max_total_tokens=POOL_TOKENS).resolved()
    engine, _, _ = build_engine(args)
    memory = MemoryOccupation(engine)
    engine.start()
    try:
        prompts = [[5 + i for i in range(n)] for n in (3, 17, 40, 9)]
        before = _greedy(engine, prompts, 16)
        held = engine.call(memory.held_bytes).result()
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        freed = engine.call(lambda: memory.release(["kv_cache", "weights"])).result()
        free1 = torch.cuda.mem_get_info()[0]
        assert freed == held["kv_cache"] + held["weights"]
        assert free1 - free0 >= 0.9 * held["kv_cache"], "the KV pool went back to the driver"
        assert engine.call(memory.held_bytes).result() == {"kv_cache": 0, "weights": 0}
        engine.call(lambda: memory.resume(["weights", "kv_cache"])).result()
        assert engine.paused is None
        assert _greedy(engine, prompts, 16) == before
    finally:
        engine.close()


def test_bench_engine_on_cuda_reports_a_bound(tmp_path: Path) -> None:
    from milepost.bench.args import BenchArgs
    from milepost.bench.engine import run_bench

    result = run_bench(BenchArgs(
        shape="tiny", device="cuda", requests=16, prompt_len=32, output_len=16, mixed_min=8,
        mixed_max=48, sessions=2, turns=3, turn_user_len=8, turn_output_len=8,
        prefill_requests=4, prefill_len=64, peak_bandwidth=4.8e12))
    rows = {r["scenario"]: r for r in result["scenarios"]}
    assert set(rows) == {"fixed", "mixed", "multiturn", "prefill"}
    assert result["dtype"] == "bfloat16" and result["kv_cache_dtype"] == "bfloat16"
    for name in ("fixed", "mixed", "multiturn"):
        assert 0 < rows[name]["bandwidth_fraction"] < 1.0
        assert rows[name]["ratio"] > 0
