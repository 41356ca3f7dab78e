"""KV pool sizing on a GPU (SGLang's --mem-fraction-static) and the kv-cache dtype setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from milepost.engine.kv_budget import cuda_kv_budget_bytes, out_of_memory_message
from milepost.engine.server_args import ServerArgs
from milepost.testing.checkpoints import make_tiny_checkpoint

GIB = 2**30


def test_budget_is_free_after_weights_minus_the_reserved_share() -> None:
    # H200-like: 140 GiB total, 1.2 GiB weights loaded, nothing else on the device.
    total, weights = 140 * GIB, int(1.2 * GIB)
    free = total - weights - GIB // 2  # the CUDA context takes some too
    budget = cuda_kv_budget_bytes(total, free, 0.85, weights)
    assert budget == free - int(total * 0.15)
    # weights + KV stay within the fraction of the total (the context is outside both)
    assert weights + budget <= 0.85 * total


def test_memory_of_other_processes_shrinks_the_pool() -> None:
    total, weights = 80 * GIB, 2 * GIB
    alone = cuda_kv_budget_bytes(total, total - weights, 0.5, weights)
    shared = cuda_kv_budget_bytes(total, total - weights - 10 * GIB, 0.5, weights)
    assert alone - shared == 10 * GIB


def test_nothing_left_names_mem_fraction_static() -> None:
    total, weights = 80 * GIB, 30 * GIB
    with pytest.raises(ValueError, match=r"--mem-fraction-static 0.3 .*raise --mem-fraction-static above 0.38"):
        cuda_kv_budget_bytes(total, total - weights, 0.3, weights)
    msg = out_of_memory_message("the KV pool of 1000 tokens", GIB, 0.9)
    assert "--mem-fraction-static is 0.9" in msg and "1.00 GiB" in msg


def test_kv_cache_dtype_auto_follows_the_model_dtype(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "qwen3", with_tokenizer=False)
    assert ServerArgs(model_path=path, device="cpu").resolved().kv_cache_dtype == "float32"
    args = ServerArgs(model_path=path, device="cpu", kv_cache_dtype="bfloat16").resolved()
    assert args.kv_cache_dtype == "bfloat16" and args.dtype == "float32"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ServerArgs(model_path=path, kv_cache_dtype="int8")
