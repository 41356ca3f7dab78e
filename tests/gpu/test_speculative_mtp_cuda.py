"""NEXTN (the checkpoint's own MTP layer as the draft) on a CUDA device: the MTP steps run over the
engine's paged cache on the device with Triton attention underneath (MLA's latent path), and
greedy outputs agree with the same engine without speculation.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_speculative_mtp_cuda.py`.
Verify chunks and plain decode steps may differ in the last bits of their logits, so tokens must
agree up to a position where the plain run's two best tokens are tied within 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.mtp_checkpoint import make_tiny_mtp_checkpoint
from tests.gpu.test_speculative_cuda import agree, generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mtp_checkpoint(tmp_path_factory.mktemp("mtp_cuda") / "m", seed=0, vocab_size=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_nextn_on_cuda_agrees_with_the_plain_engine(ckpt, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (5 + 9 * i,), generator=g).tolist() for i in range(6)]
    runs = {}
    for algo in (None, "NEXTN"):
        flags = {"speculative_algorithm": algo} if algo else {}
        engine = build_engine(ServerArgs(model_path=ckpt, device="cuda", dtype=dtype, page_size=16,
                                         max_total_tokens=8192, mem_fraction_static=0.5,
                                         max_running_requests=16, **flags).resolved())[0]
        runs[algo] = (generate(engine, prompts, 24), engine)
    plain, (spec, engine) = runs[None][0], runs["NEXTN"]
    assert engine.speculator.stats.proposed > 50
    compared = sum(agree(plain[i], spec[i]) for i in plain)
    assert compared >= 0.8 * 6 * 24, f"only {compared} positions before ties"
