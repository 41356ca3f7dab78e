"""Choosing the attention backend and CUDA graphs by device: CPU keeps the reference path, bad
combinations are refused naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from milepost.engine.runner import ModelRunner
from milepost.engine.server_args import ServerArgs
from milepost.models.attention import PagedKVCache, TorchPagedAttention
from milepost.models.triton_attention import make_paged_attention


def _cache() -> PagedKVCache:
    return PagedKVCache(1, 4, 4, 2, 16, torch.float32, "cpu")


def test_auto_picks_the_torch_reference_on_cpu() -> None:
    assert isinstance(make_paged_attention(_cache(), "auto"), TorchPagedAttention)
    assert isinstance(make_paged_attention(_cache(), "torch"), TorchPagedAttention)


def test_triton_on_cpu_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--attention-backend triton needs a CUDA device"):
        make_paged_attention(_cache(), "triton")


def test_server_args_refuse_triton_on_cpu(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    args = ServerArgs(model_path=tmp_path, device="cpu", attention_backend="triton")
    with pytest.raises(ValueError, match="--attention-backend triton runs GPU kernels"):
        args.resolved()
    ok = ServerArgs(model_path=tmp_path, device="cpu").resolved()
    assert ok.attention_backend == "auto" and not ok.disable_cuda_graph
    with pytest.raises(ValueError, match="--cuda-graph-max-bs must be >= 1"):
        ServerArgs(model_path=tmp_path, cuda_graph_max_bs=0)


def test_runner_refuses_cuda_graphs_on_cpu() -> None:
    class Tiny:
        moe_top_k = 0

    with pytest.raises(ValueError, match="--disable-cuda-graph"):
        ModelRunner(Tiny(), _cache(), torch.device("cpu"), cuda_graph_max_bs=8, context_length=64)
