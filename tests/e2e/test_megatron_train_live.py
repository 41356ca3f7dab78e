"""The Megatron backend on two gloo ranks trains like the FSDP backend on the same batch (two
optimizer steps, several micro-batches, KL to a reference, clipping), resumes exactly from its
checkpoint, and gives transformers' logits.

One two-rank run (module fixture) computes every case: the FSDP references (data parallel 2), then
EP = 2 (Qwen3-MoE, data parallel 2), R3 under EP = 2, TP = 2 (Qwen3: tied embeddings, per-head q/k
norms; also with GSPO + TIS), PP = 2 (Qwen3, Qwen3-MoE), offload / onload under EP = 2, megatron's
distributed optimizer (EP = 2 and plain data parallel 2; its offload), TP peers given different
samples, and the logits of TP = 2 / EP = 2 vs transformers. A
rank's start-up (imports) costs more than all the tiny cases together, so they share one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core not installed (pip install 'milepost[megatron]')")
TWO_RANKS = pytest.mark.xdist_group("megatron_two_ranks")  # one worker runs the shared fixture once

R3 = {"use_rollout_routing_replay": True}
# Another objective and a correction through the shared loss path: GSPO's sequence-level ratio,
# sequence-mean aggregation, TIS weights on the rollout ratio (the random rollout log-probs make
# them ~0.07, inside the default [0, 2]: every token's own weight), the low-variance KL. With
# bounds [0.5, 1.5] every weight is clipped to 0.5, and after the first step the layouts spread
# past 1e-5 (FSDP, Megatron TP = 2 and PP = 2 alike: grad_norm 4.21667 / 4.21659 / 4.21664;
# one optimizer step agrees to 2e-7): fp32 noise grown by Adam, not a difference of the backends.
GSPO_TIS = {"ratio_level": "sequence", "loss_aggregation": "sequence_mean", "ratio_correction": "tis",
            "kl_loss_type": "low_var_kl"}
DIST_OPT = {"use_distributed_optimizer": True}  # megatron's DDP buffers + DistributedOptimizer


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("megatron_two_ranks")
    moe = str(make_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", with_tokenizer=False))
    dense = str(make_tiny_checkpoint(root / "qwen3", "qwen3", with_tokenizer=False))

    def train(path: str, backend: str, tp: int = 1, ep: int = 1, ckpt: str | None = None,
              overrides: dict | None = None, pp: int = 1) -> dict:
        return {"fn": "train_once", "args": [path, backend, tp, ep, ckpt and str(root / ckpt), overrides, pp]}

    cases = {
        "fsdp_moe": train(moe, "fsdp"), "fsdp_moe_r3": train(moe, "fsdp", overrides=R3),
        "fsdp_dense": train(dense, "fsdp"), "fsdp_dense_gspo": train(dense, "fsdp", overrides=GSPO_TIS),
        "ep": train(moe, "megatron", ep=2, ckpt="ckpt_ep"),
        "ep_r3": train(moe, "megatron", ep=2, ckpt="ckpt_ep_r3", overrides=R3),
        "tp": train(dense, "megatron", tp=2, ckpt="ckpt_tp"),
        "tp_gspo": train(dense, "megatron", tp=2, ckpt="ckpt_tp_gspo", overrides=GSPO_TIS),
        "offload": {"fn": "offload_round_trip", "args": [moe, 1, 2]},
        "ep_dopt": train(moe, "megatron", ep=2, ckpt="ckpt_ep_dopt", overrides=DIST_OPT),
        "dp_dopt": train(dense, "megatron", ckpt="ckpt_dp_dopt", overrides=DIST_OPT),
        "offload_dopt": {"fn": "offload_round_trip", "args": [moe, 1, 2, DIST_OPT]},
        "pp": train(dense, "megatron", pp=2, ckpt="ckpt_pp"), "pp_moe": train(moe, "megatron", pp=2, ckpt="ckpt_pp_moe"),
        "wrong_split": {"fn": "wrong_split", "args": [dense]},
        "logits": {"fn": "logits_gaps", "args": [[(dense, 2, 1), (moe, 2, 1), (moe, 1, 2)]]},
        "gate": {"fn": "router_gate_under_autocast", "args": [moe]},
        "pp1": {"fn": "pipeline_grads", "args": [dense, 1]}, "pp2": {"fn": "pipeline_grads", "args": [dense, 2]},
    }
    from milepost.train.megatron.parity import run_cases

    return run_ranks(run_cases, 2, cases, timeout_s=300)


def _compare(two_ranks: list[dict], ref_case: str, case: str) -> list[dict]:
    ref = two_ranks[0][ref_case]
    ranks = [r[case] for r in two_ranks]
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


@TWO_RANKS
def test_expert_parallel_trains_like_fsdp(two_ranks: list[dict]) -> None:
    _compare(two_ranks, "fsdp_moe", "ep")


@TWO_RANKS
def test_routing_replay_with_expert_parallel_like_fsdp(two_ranks: list[dict]) -> None:
    """R3 through megatron's RouterReplay under EP = 2 equals the FSDP backend's R3 (random engine
    routings, so nearly every token's natural routing differs: the metric must say so on both)."""
    ranks = _compare(two_ranks, "fsdp_moe_r3", "ep_r3")
    assert ranks[0]["metrics"][0]["r3_routing_mismatch_frac"] > 0.9
    assert two_ranks[0]["fsdp_moe_r3"]["metrics"][0]["r3_routing_mismatch_frac"] > 0.9


@TWO_RANKS
def test_tensor_parallel_trains_like_fsdp(two_ranks: list[dict]) -> None:
    _compare(two_ranks, "fsdp_dense", "tp")


@TWO_RANKS
def test_sequence_ratio_and_tis_correction_like_fsdp(two_ranks: list[dict]) -> None:
    """GSPO-style sequence ratio, sequence-mean aggregation, TIS and the low-variance KL under
    TP = 2: the FSDP numbers, the correction's metrics included."""
    ranks = _compare(two_ranks, "fsdp_dense_gspo", "tp_gspo")
    metrics = ranks[0]["metrics"][0]
    assert 0 < metrics["rollout_ratio"] < 0.5, metrics  # the weights differ from 1: TIS acts


@TWO_RANKS
def test_offload_and_onload_keep_training_exact(two_ranks: list[dict]) -> None:
    """EP = 2 on Qwen3-MoE: a train step while offloaded is refused; after onload the second
    rollout equals the same two rollouts with no offload (CPU: the same bits)."""
    for rank in two_ranks:
        result = rank["offload"]
        assert "called while offloaded; call onload() first" in result["refused"]
        assert result["offload"]["metrics"] == result["straight"]["metrics"]
        for name, weight in result["straight"]["hf"].items():
            assert torch.equal(result["offload"]["hf"][name], weight), name


@TWO_RANKS
def test_distributed_optimizer_trains_like_adamw_and_fsdp(two_ranks: list[dict]) -> None:
    """--use-distributed-optimizer (megatron's DDP buffers, reduce-scatter, DistributedOptimizer,
    all-gather) on Qwen3-MoE with EP = 2 (dense weights data parallel 2, experts 1) and on Qwen3
    with data parallel 2: FSDP's numbers and the AdamW path's, resume bit-exact (in _compare)."""
    _compare(two_ranks, "fsdp_moe", "ep_dopt")
    _compare(two_ranks, "ep", "ep_dopt")
    _compare(two_ranks, "fsdp_dense", "dp_dopt")


@TWO_RANKS
def test_distributed_optimizer_keeps_one_shard_of_adam_state_per_rank(two_ranks: list[dict]) -> None:
    """Each rank holds Adam moments (2 x fp32) for its half of megatron's flat buffer only: the two
    shards add up to every weight exactly once; the halves differ by the buffer's alignment padding.
    Experts (expert data parallel 1 under EP = 2) stay whole on their rank."""
    dense_numel = sum(w.numel() for w in two_ranks[0]["fsdp_dense"]["hf"].values())
    full = 8 * dense_numel  # exp_avg and exp_avg_sq, fp32, every weight (tied embedding once)
    ranks = [r["dp_dopt"]["adam_bytes"] for r in two_ranks]
    print("dense DP=2: Adam bytes per rank", ranks, "of", full)
    assert sum(ranks) == full and max(ranks) <= 0.55 * full
    moe = {k: w.numel() for k, w in two_ranks[0]["fsdp_moe"]["hf"].items()}
    dense_moe = 8 * sum(n for k, n in moe.items() if ".experts." not in k)
    saved = [r["ep"]["adam_bytes"] - r["ep_dopt"]["adam_bytes"] for r in two_ranks]
    print("MoE EP=2: Adam bytes per rank, AdamW", [r["ep"]["adam_bytes"] for r in two_ranks],
          "distributed", [r["ep_dopt"]["adam_bytes"] for r in two_ranks], "dense state", dense_moe)
    assert sum(saved) == dense_moe and min(saved) >= 0.45 * dense_moe  # half the dense state each, experts kept


@TWO_RANKS
def test_distributed_optimizer_offload_and_onload_keep_training_exact(two_ranks: list[dict]) -> None:
    for rank in two_ranks:
        result = rank["offload_dopt"]
        assert "called while offloaded; call onload() first" in result["refused"]
        assert result["offload"]["metrics"] == result["straight"]["metrics"]
        for name, weight in result["straight"]["hf"].items():
            assert torch.equal(result["offload"]["hf"][name], weight), name


@TWO_RANKS
def test_tensor_parallel_peers_with_different_samples_are_refused(two_ranks: list[dict]) -> None:
    for rank in two_ranks:
        assert "tensor/pipeline-parallel group were given different samples" in rank["wrong_split"]


@TWO_RANKS
def test_tensor_and_expert_parallel_logits(two_ranks: list[dict]) -> None:
    """TP = 2 (Qwen3, Qwen3-MoE) and EP = 2 (Qwen3-MoE) give transformers' logits (fp32)."""
    for rank, result in enumerate(two_ranks):
        for case, gap in zip(("qwen3 tp2", "qwen3_moe tp2", "qwen3_moe ep2"), result["logits"]):
            assert gap["ref_abs_max"] > 1.0
            assert gap["max_abs_diff"] < 1e-4, (rank, case, gap)


@TWO_RANKS
def test_moe_router_gate_trains_under_autocast(two_ranks: list[dict]) -> None:
    """bf16 autocast: megatron's own gate raises in backward (seen on the H200 in bf16 Qwen3-MoE
    training, reproduced here on the CPU); ours gives fp32 logits and a gradient."""
    for rank in two_ranks:
        gate = rank["gate"]
        assert gate["dtype"] == "torch.float32" and 0 < gate["grad_abs_sum"] < float("inf"), gate
        assert "same dtype" in gate["megatron_error"], gate


@TWO_RANKS
def test_pipeline_schedule_runs_on_cpu_like_one_stage(two_ranks: list[dict]) -> None:
    """megatron-core's 1F1B schedule with PP = 2 on gloo (cpu_shim) gives the losses and every
    layer's gradients of PP = 1 (megatron's schedule alone; the backend's PP runs are below)."""
    ref = two_ranks[0]["pp1"]
    stages = [r["pp2"] for r in two_ranks]
    assert stages[1]["losses"] == pytest.approx(ref["losses"], rel=1e-6) and stages[0]["losses"] == []
    layers = {**stages[0]["grads"], **stages[1]["grads"]}
    for name, grad in ref["grads"].items():
        if name != "embedding.word_embeddings.weight":  # tied: its two stage copies sum in finalize_model_grads
            torch.testing.assert_close(layers[name], grad, rtol=1e-5, atol=1e-7)
    assert sum(name.startswith("decoder.layers.") for name in layers) == sum(
        name.startswith("decoder.layers.") for name in ref["grads"])


@TWO_RANKS
def test_pipeline_parallel_trains_like_fsdp(two_ranks: list[dict]) -> None:
    """PP = 2 through megatron's 1F1B schedule (packed micro-batches of varying length; Qwen3's tied
    embedding split over the two stages, its gradient summed over them): the FSDP numbers."""
    _compare(two_ranks, "fsdp_dense", "pp")


@TWO_RANKS
def test_pipeline_parallel_moe_trains_like_fsdp(two_ranks: list[dict]) -> None:
    """PP = 2 on Qwen3-MoE (each schedule call's micro-batches padded to one length: megatron's
    allgather dispatcher refuses variable lengths)."""
    _compare(two_ranks, "fsdp_moe", "pp_moe")


@pytest.mark.slow
@pytest.mark.optin  # four ranks on two cores: 91 s at load 9-10, past the default suite's budget
def test_tensor_and_expert_parallel_together_train_like_fsdp(tmp_path: Path) -> None:
    """TP = 2 and EP = 2 on four ranks (Qwen3-MoE; sequence parallel, which megatron needs to train
    MoE under TP) against FSDP on the same four ranks: the same checks as above, and the logits.
    Pipeline parallel composed with the others on the same four ranks: PP = 2 x TP = 2 (Qwen3, tied
    embedding) and PP = 2 x EP = 2 (Qwen3-MoE, data parallel 2). The distributed optimizer under
    TP = 2 x EP = 2 (experts sharded over expert data parallel 2) and PP = 2 x DP = 2 (the tied
    embedding's two stage copies summed before the data-parallel reduce-scatter)."""
    from milepost.train.megatron.parity import run_cases

    moe = str(make_tiny_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", with_tokenizer=False))
    dense = str(make_tiny_checkpoint(tmp_path / "qwen3", "qwen3", with_tokenizer=False))
    cases = {"fsdp_moe": {"fn": "train_once", "args": [moe, "fsdp", 1, 1, None, None]},
             "fsdp_dense": {"fn": "train_once", "args": [dense, "fsdp", 1, 1, None, None]},
             "tp_ep": {"fn": "train_once", "args": [moe, "megatron", 2, 2, str(tmp_path / "ckpt"), None]},
             "pp_tp": {"fn": "train_once", "args": [dense, "megatron", 2, 1, str(tmp_path / "ckpt_pp_tp"), None, 2]},
             "pp_ep": {"fn": "train_once", "args": [moe, "megatron", 1, 2, str(tmp_path / "ckpt_pp_ep"), None, 2]},
             # the distributed optimizer where its shards split more than dense weights: experts over
             # expert data parallel 2 (TP 2 x EP 2), and the tied embedding of two stages (PP 2 x DP 2)
             "tp_ep_dopt": {"fn": "train_once", "args": [moe, "megatron", 2, 2, str(tmp_path / "ckpt_tp_ep_dopt"),
                                                         DIST_OPT]},
             "pp_dp_dopt": {"fn": "train_once", "args": [dense, "megatron", 1, 1, str(tmp_path / "ckpt_pp_dp_dopt"),
                                                         DIST_OPT, 2]},
             "logits": {"fn": "logits_gaps", "args": [[(moe, 2, 2)]]}}
    ranks = run_ranks(run_cases, 4, cases, timeout_s=400)
    for ref, case in (("fsdp_moe", "tp_ep"), ("fsdp_dense", "pp_tp"), ("fsdp_moe", "pp_ep"),
                      ("fsdp_moe", "tp_ep_dopt"), ("fsdp_dense", "pp_dp_dopt")):
        _compare(ranks, ref, case)
        for rank in ranks:
            assert rank[case]["metrics"] == ranks[0][case]["metrics"], case
    for rank in ranks:
        assert 1.0 < rank["logits"][0]["ref_abs_max"] and rank["logits"][0]["max_abs_diff"] < 1e-4, rank["logits"]


@pytest.mark.slow
def test_bench_train_runs_both_backends(tmp_path: Path) -> None:
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
