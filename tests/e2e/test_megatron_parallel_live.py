"""Megatron-core on two gloo ranks: TP = 2 (Qwen3, Qwen3-MoE) and EP = 2 (Qwen3-MoE) give
transformers' logits within fp32 tolerance, from the same Hugging Face checkpoint."""

from __future__ import annotations

import importlib.util

import pytest

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core not installed (pip install 'milepost[megatron]')")


@pytest.mark.slow
def test_tensor_and_expert_parallel_logits(tmp_path):
    from milepost.train.megatron.parity import logits_gaps

    dense = str(make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False))
    moe = str(make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False))
    cases = [(dense, 2, 1), (moe, 2, 1), (moe, 1, 2)]
    per_rank = run_ranks(logits_gaps, 2, cases, timeout_s=120)
    for rank, gaps in enumerate(per_rank):
        for case, gap in zip(cases, gaps):
            assert gap["ref_abs_max"] > 1.0
            assert gap["max_abs_diff"] < 1e-4, (rank, case, gap)
