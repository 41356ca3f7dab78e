"""The Megatron backend on one GPU (TP = PP = EP = 1): logits equal transformers within bf16
tolerance, and training equals the FSDP backend on the same batch (fp32 and bf16 compute).

Run on the accelerator machine with megatron-core installed from its wheel (no internet there):
    pip install --no-deps .whl/megatron_core-0.16.1-*.whl
    python -m pytest -q -m gpu tests/gpu/test_megatron_cuda.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed"),
]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("bfloat16", 0.25)])
def test_logits_equal_transformers_on_cuda(tmp_path, dtype, tol):
    from milepost.train.megatron.parity import logits_gaps

    paths = [str(make_tiny_checkpoint(tmp_path / a, a, with_tokenizer=False)) for a in ("llama", "qwen3", "qwen3_moe")]
    [gaps] = run_ranks(logits_gaps, 1, [(p, 1, 1) for p in paths], dtype, backend="nccl")
    for path, gap in zip(paths, gaps):
        assert gap["ref_abs_max"] > 1.0
        # fp32 on CUDA: TF32-free matmuls may still reorder sums; bf16: a few ulps of logits ~5
        assert gap["max_abs_diff"] < tol, (path, gap)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trains_like_fsdp_on_cuda(tmp_path, arch, dtype):
    from milepost.train.megatron.parity import train_once

    path = str(make_tiny_checkpoint(tmp_path / arch, arch, with_tokenizer=False))
    overrides = {"device": "cuda", "dtype": dtype}
    [ref] = run_ranks(train_once, 1, path, "fsdp", 1, 1, None, overrides, backend="nccl")
    [got] = run_ranks(train_once, 1, path, "megatron", 1, 1, str(tmp_path / "ckpt"), overrides, backend="nccl")
    rel = 1e-3 if dtype == "float32" else 5e-2
    for key, value in ref["metrics"][0].items():
        assert got["metrics"][0][key] == pytest.approx(value, rel=rel, abs=rel * 0.1), key
    atol = 1e-3 if dtype == "float32" else 2e-2
    for name, weight in ref["hf"].items():
        torch.testing.assert_close(got["hf"][name].float(), weight.float(), rtol=0, atol=atol)
    for key, value in got["second"].items():  # resume: CUDA's atomics may reorder sums, hence approx
        assert got["again"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-30b-a3b"])
def test_bench_megatron_beside_fsdp(tmp_path, shape, capsys):
    """Tokens/s and peak memory of both backends in one run (printed for the notes). The
    Megatron side runs megatron's local (unfused, O(T^2)) attention: micro-batches of 2048 tokens.
    30B-A3B: a few layers only (--layers 4), one GPU."""
    import json

    from milepost.bench.train import main

    out = tmp_path / "bench.json"
    layers = ["--layers", "4"] if "a3b" in shape else []
    assert main(["--shape", shape, *layers, "--samples", "8", "--prompt", "256", "--response", "256",
                 "--micro-batch-tokens", "2048", "--steps", "2", "--backend", "both", "--no-hf",
                 "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    print(capsys.readouterr().out)
    for side in ("milepost", "megatron"):
        assert report[side]["tokens_per_s"] > 0 and report[side]["peak_gib"] > 0
    assert report["megatron"]["grad_norm"] == pytest.approx(report["milepost"]["grad_norm"], rel=5e-2)
