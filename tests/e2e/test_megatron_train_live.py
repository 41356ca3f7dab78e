"""The Megatron backend trains like the FSDP backend on the same batch (two optimizer steps,
several micro-batches, KL to a reference, clipping), and resumes exactly from its checkpoint.

Default suite: expert parallel (EP = 2, Qwen3-MoE, data parallel 2) against FSDP on one rank.
Slow: tensor parallel (TP = 2, Qwen3, tied embeddings, per-head q/k norms)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core not installed (pip install 'milepost[megatron]')")


def _compare(tmp_path, arch: str, tp: int, ep: int, overrides: dict | None = None) -> list[dict]:
    from milepost.train.megatron.parity import train_once

    path = str(make_tiny_checkpoint(tmp_path / arch, arch, with_tokenizer=False))
    [ref] = run_ranks(train_once, 1, path, "fsdp", 1, 1, None, overrides, timeout_s=120)
    ranks = run_ranks(train_once, 2, path, "megatron", tp, ep, str(tmp_path / "ckpt"), overrides, timeout_s=180)
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    expected, got = ref["metrics"][0], ranks[0]["metrics"][0]
    assert expected.keys() == got.keys()
    assert got["optimizer_steps"] == 2 and got["pg_clipfrac"] > 0 and got["kl"] > 0
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert sorted(ranks[0]["hf"]) == sorted(ref["hf"])  # the engines' names, every weight
    for name, weight in ref["hf"].items():
        torch.testing.assert_close(ranks[0]["hf"][name], weight, rtol=0, atol=1e-4)
        torch.testing.assert_close(ranks[1]["hf"][name], ranks[0]["hf"][name], rtol=0, atol=0)
    for a, b in zip(ref["logprobs"] + ref["ref_logprobs"], ranks[0]["logprobs"] + ranks[0]["ref_logprobs"]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    # exact resume: the second rollout after reloading equals the second rollout straight on
    for rank in ranks:
        assert rank["extra"] == {"step": 1}
        assert rank["again"] == rank["second"]
        for name, weight in rank["second_hf"].items():
            assert torch.equal(rank["again_hf"][name], weight), name
    return ranks


def test_expert_parallel_trains_like_fsdp(tmp_path):
    _compare(tmp_path, "qwen3_moe", tp=1, ep=2)


@pytest.mark.slow
def test_routing_replay_with_expert_parallel_like_fsdp(tmp_path):
    """R3 through megatron's RouterReplay under EP = 2 equals the FSDP backend's R3 (random engine
    routings, so nearly every token's natural routing differs: the metric must say so on both)."""
    ranks = _compare(tmp_path, "qwen3_moe", tp=1, ep=2, overrides={"use_rollout_routing_replay": True})
    assert ranks[0]["metrics"][0]["r3_routing_mismatch_frac"] > 0.9


@pytest.mark.slow
def test_tensor_parallel_trains_like_fsdp(tmp_path):
    _compare(tmp_path, "qwen3", tp=2, ep=1)


@pytest.mark.slow
def test_bench_train_runs_both_backends(tmp_path):
    import json

    from milepost.bench.train import main

    out = tmp_path / "bench.json"
    assert main(["--shape", "tiny", "--samples", "4", "--prompt", "16", "--response", "16", "--steps", "1",
                 "--backend", "both", "--no-hf", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["milepost"]["tokens_per_s"] > 0 and report["megatron"]["tokens_per_s"] > 0
    assert report["megatron_ratio"] == pytest.approx(
        report["megatron"]["tokens_per_s"] / report["milepost"]["tokens_per_s"])
    # same batch, same initial weights: the first step's gradient norm agrees across backends
    assert report["megatron"]["grad_norm"] == pytest.approx(report["milepost"]["grad_norm"], rel=1e-3)


def _wrong_split(rank: int, world: int, path: str) -> str:
    from milepost.testing.batches import random_train_batch
    from milepost.train.megatron.backend import MegatronBackend
    from milepost.train.megatron.parallel import ParallelSizes
    from milepost.train.settings import TrainerSettings

    trainer = MegatronBackend.create(path, TrainerSettings(global_batch_size=2), ParallelSizes(tp=2))
    batch = random_train_batch(4, 1)
    try:  # FSDP-style split by global rank: TP peers get different samples
        trainer.train_step(batch.select([rank, rank + 2]))
    except ValueError as err:
        return str(err)
    return "trained"


@pytest.mark.slow
def test_tensor_parallel_peers_with_different_samples_are_refused(tmp_path):
    path = str(make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False))
    for message in run_ranks(_wrong_split, 2, path, timeout_s=180):
        assert "tensor-parallel group were given different samples" in message
