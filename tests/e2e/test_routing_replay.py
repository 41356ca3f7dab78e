"""Rollout routing replay (R3) on a tiny Qwen3-MoE: the engine records experts, the trainer replays them.

The engine (`milepost serve`, a real process) generates with return_routed_experts. The trainer's
router weights are then perturbed, so its own top-k differs from the rollout's for some tokens.
With R3 on, the experts the trainer's MoE layers actually compute with (captured at the expert
module's input) equal the rollout's for 100% of tokens and every layer; with it off they differ
for a measured fraction; the router still receives gradients under replay.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.models.qwen3_moe import SparseMoeBlock, StackedExperts
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.testing.server_process import ServerProcess
from milepost.train.batch import TrainBatch
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.train.replay import decode_routed_experts
from milepost.types import Sample

PROMPTS = [[11, 200, 35, 7, 480, 91, 64, 5], [40, 9, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [77, 78, 79, 80]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("r3"), "qwen3_moe", seed=5, with_tokenizer=False)
    with ServerProcess(path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/generate", json={
            "input_ids": PROMPTS, "return_routed_experts": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}})
        assert r.status_code == 200, r.text
    samples = []
    for i, (prompt, out) in enumerate(zip(PROMPTS, r.json())):
        tokens = prompt + out["output_ids"]
        samples.append(Sample(0, i, tokens=tokens, response_length=len(out["output_ids"]), reward=float(i % 2),
                              routed_experts=out["meta_info"]["routed_experts"]))
    return path, samples


def _perturb_routers(backend: FSDPBackend, scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in backend.policy.modules():
            if isinstance(block, SparseMoeBlock):
                w = block.gate.weight
                local = w.to_local() if isinstance(w, DTensor) else w
                local.add_(torch.randn(local.shape, generator=g) * scale * float(local.std()))


def replay_worker(rank: int, world: int, path: str, samples: list[Sample], r3: bool) -> dict:
    settings = TrainerSettings(lr=1e-2, global_batch_size=len(samples), use_rollout_routing_replay=r3)
    backend = FSDPBackend.create(path, settings)
    _perturb_routers(backend, 0.3)
    used: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for layer_id, layer in enumerate(backend.policy.lm.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, StackedExperts)
        hooks.append(experts.register_forward_pre_hook(
            lambda _m, args, i=layer_id: used.setdefault(i, []).append(args[1].detach().clone())))
    backend.compute_logprobs(samples)  # one packed forward: what the trainer computes with
    for h in hooks:
        h.remove()
    gate_before = [b.gate.weight.full_tensor().clone() for b in backend.policy.modules() if isinstance(b, SparseMoeBlock)]
    batch = TrainBatch.from_samples(samples, [torch.ones(s.response_length) for s in samples],
                                    routed_experts=backend.routed_experts_of(samples) if r3 else None)
    metrics = backend.train_step(batch)
    gate_after = [b.gate.weight.full_tensor() for b in backend.policy.modules() if isinstance(b, SparseMoeBlock)]
    lm = backend.policy.lm
    return {
        "used": {i: torch.cat(v) for i, v in used.items()},
        "layers": lm.num_layers, "top_k": lm.moe_top_k,
        "metrics": metrics,
        "router_moved": max(float((a - b).detach().abs().max()) for a, b in zip(gate_after, gate_before)),
    }


def agreement(result: dict, samples: list[Sample]) -> tuple[float, float]:
    """(share of tokens whose expert sets equal the rollout's in every layer, share of (token, layer)
    pairs that do), over every token the engine routed (all but each sequence's last)."""
    token_ok, pair_ok, tokens, start = 0, 0, 0, 0
    for s in samples:
        n = len(s.tokens)
        rollout = decode_routed_experts(s.routed_experts, n, result["layers"], result["top_k"])
        same = torch.stack([
            (result["used"][layer][start : start + n - 1].sort(-1).values == rollout[:, layer].long().sort(-1).values).all(-1)
            for layer in range(result["layers"])
        ], dim=1)  # [n - 1, layers]
        token_ok += int(same.all(-1).sum())
        pair_ok += int(same.sum())
        tokens += n - 1
        start += n
    return token_ok / tokens, pair_ok / (tokens * result["layers"])


def test_r3_replays_rollout_experts_for_every_token(moe) -> None:
    path, samples = moe
    on = run_ranks(replay_worker, 1, str(path), samples, True)[0]
    off = run_ranks(replay_worker, 1, str(path), samples, False)[0]
    on_tokens, on_pairs = agreement(on, samples)
    off_tokens, off_pairs = agreement(off, samples)
    print(f"R3 on: {on_tokens:.3f} of tokens match; R3 off: {1 - off_tokens:.3f} of tokens "
          f"({1 - off_pairs:.3f} of token-layers) differ; mismatch metric {on['metrics']['r3_routing_mismatch_frac']:.3f}")
    assert on_tokens == 1.0 and on_pairs == 1.0
    assert off_tokens < 1.0  # the perturbed routers pick other experts for a measurable share
    # R3 reports how often the trainer's natural routing would have differed: some, not all.
    assert 0.0 < on["metrics"]["r3_routing_mismatch_frac"] < 1.0
    assert "r3_routing_mismatch_frac" not in off["metrics"]
    assert on["router_moved"] > 0.0  # the router still gets gradients under replay


def test_r3_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    dense = make_tiny_checkpoint(tmp_path / "dense", "qwen3", with_tokenizer=False)
    with pytest.raises(Exception, match="--use-rollout-routing-replay.*dense model"):
        run_ranks(_dense_worker, 1, str(dense))


def _dense_worker(rank: int, world: int, path: str) -> None:
    FSDPBackend.create(path, TrainerSettings(global_batch_size=1, use_rollout_routing_replay=True))
