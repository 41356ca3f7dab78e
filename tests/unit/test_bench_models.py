"""The benchmark's two models: transformers' copy computes what the native model computes;
decode byte accounting counts what a step reads."""

from __future__ import annotations

import pytest
import torch

from milepost.bench.args import BenchArgs
from milepost.bench.models import hf_copy, native_model, weight_bytes_per_decode_step
from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import ForwardContext


def test_hf_copy_has_the_native_weights() -> None:
    native, _ = native_model(None, "tiny", torch.float32, torch.device("cpu"), seed=3)
    ids = torch.tensor([11, 40, 300, 7, 99])
    pos = torch.arange(len(ids))
    ctx = ForwardContext(attention=VarlenCausalAttention(torch.tensor([0, len(ids)])))
    with torch.no_grad():
        ours = native.compute_logits(native.forward(ids, pos, ctx))
    hf = hf_copy(native, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_decode_bytes_count_weights_once_and_experts_touched() -> None:
    native, _ = native_model(None, "tiny", torch.float32, torch.device("cpu"), seed=0)
    total = sum(p.numel() * 4 for p in {p.data_ptr(): p for p in native.parameters()}.values())
    assert weight_bytes_per_decode_step(native, 1) == total  # tied embedding: read by the LM head
    assert weight_bytes_per_decode_step(native, 256) == total


def test_bench_args_refuse_bad_combinations(tmp_path) -> None:
    with pytest.raises(ValueError, match="exactly one of --model"):
        BenchArgs()
    with pytest.raises(ValueError, match="exactly one of --model"):
        BenchArgs(model=tmp_path, shape="tiny")
    with pytest.raises(ValueError, match="--mixed-min"):
        BenchArgs(shape="tiny", mixed_min=50, mixed_max=10)
    with pytest.raises(ValueError, match="--requests must be >= 1"):
        BenchArgs(shape="tiny", requests=0)
