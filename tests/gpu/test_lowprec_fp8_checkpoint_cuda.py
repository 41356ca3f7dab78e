"""An FP8 blockwise checkpoint served on the H200 (native FP8 GEMMs): the engine's float8 weights
and tile scales are the checkpoint's bytes, and its greedy tokens and log-probs equal an engine
that quantized the bf16 source on load (the same bytes through the same kernels). Run on the
accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_lowprec_fp8_checkpoint_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.lowprec.contract import Contract
from milepost.lowprec.convert import convert_checkpoint
from milepost.lowprec.engine_store import QuantizedLinear
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.engine_greedy import greedy_outputs, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path: Path, **kw: object) -> object:
    args = ServerArgs(model_path=path, device="cuda", dtype="bfloat16", page_size=16,
                      max_total_tokens=4096, **kw).resolved()
    return build_engine(args)[0]


def _greedy(engine: object) -> tuple[list[list[int]], list[list[float]]]:
    return greedy_outputs(engine, random_prompts((37, 5, 130), seed=7), max_new_tokens=16)


def test_native_fp8_engine_serves_the_checkpoint_bytes(tmp_path: Path) -> None:
    # Every projection tile-aligned (q 256, k/v 128, gate/up 512 rows; K 256 / 512): native GEMMs.
    src = make_tiny_checkpoint(tmp_path / "bf16", "qwen3", seed=3, with_tokenizer=False,
                               hidden_size=256, intermediate_size=512, head_dim=64,
                               num_attention_heads=4, num_key_value_heads=2)
    # A bf16 source, as real ones are: the bf16 engine quantizes its bf16 weights on load, so
    # from an fp32 file the two would quantize different values (H100, 2026-12-06: scales off by
    # ~1%, tokens parted at the second step).
    shard = src / "model.safetensors"
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(shard).items()}, shard, metadata={"format": "pt"})
    convert_checkpoint(src, tmp_path / "fp8", Contract("fp8_block", "fp8_block"))
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    a = _engine(tmp_path / "fp8")
    model = a.runner.model
    native = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.native]
    assert native, "no native FP8 linear: is this a Hopper GPU with an FP8 GEMM that passed the probe?"
    for n, t in stored.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        m, j = model.fp8_weights._part(model.weight_view(n))
        row, rows, q = m.qparts[j]
        assert torch.equal(m.weight[row:row + rows].view(torch.uint8).cpu(), t.view(torch.uint8)), n
        assert torch.equal(q.scales.cpu(), stored[n.removesuffix("weight") + "weight_scale_inv"]), n
    got = _greedy(a)
    del a, model
    torch.cuda.empty_cache()
    assert got == _greedy(_engine(src, quantization="fp8_block"))
