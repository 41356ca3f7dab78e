"""Rollout routing replay (R3) on the new native MoE families: gpt-oss and DeepSeek-V3 style.

As tests/e2e/test_routing_replay.py does for Qwen3-MoE: `milepost serve` records the experts it
used, the trainer's routers are perturbed, and with R3 the experts its MoE layers compute with equal
the rollout's for every token and MoE layer (without R3 some differ); the router still trains.
DeepSeek's first layer is dense: the engine reports -1 there and the trainer ignores it.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.models.qwen3_moe import SparseMoeBlock
from milepost.testing.dist import run_ranks
from milepost.testing.hf_archs import make_tiny_hf_checkpoint
from milepost.testing.server_process import ServerProcess
from milepost.train.batch import TrainBatch
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.train.replay import decode_routed_experts
from milepost.types import Sample

PROMPTS = [[11, 200, 35, 7, 480, 91, 64, 5], [40, 9, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def worker(rank: int, world: int, path: str, samples: list[Sample], r3: bool) -> dict:
    backend = FSDPBackend.create(path, TrainerSettings(lr=1e-2, global_batch_size=len(samples),
                                                       use_rollout_routing_replay=r3))
    blocks = {b.layer_id: b for b in backend.policy.modules() if isinstance(b, SparseMoeBlock)}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for b in blocks.values():
            w = b.gate.weight
            local = w.to_local() if isinstance(w, DTensor) else w
            local.add_(torch.randn(local.shape, generator=g) * 0.5 * float(local.std()))
    used: dict[int, list[torch.Tensor]] = {}
    hooks = [b.experts.register_forward_pre_hook(lambda _m, args, i=i: used.setdefault(i, []).append(args[1].clone()))
             for i, b in blocks.items()]
    backend.compute_logprobs(samples)
    for h in hooks:
        h.remove()
    before = [b.gate.weight.full_tensor().clone() for b in blocks.values()]
    batch = TrainBatch.from_samples(samples, [torch.ones(s.response_length) for s in samples],
                                    routed_experts=backend.routed_experts_of(samples) if r3 else None)
    backend.train_step(batch)
    moved = max(float((b.gate.weight.full_tensor() - w).abs().max()) for b, w in zip(blocks.values(), before))
    lm = backend.policy.lm
    return {"used": {i: torch.cat(v) for i, v in used.items()}, "layers": lm.num_layers,
            "top_k": lm.moe_top_k, "moved": moved}


def token_agreement(result: dict, samples: list[Sample]) -> float:
    """Share of routed tokens whose expert sets equal the rollout's in every MoE layer."""
    ok, tokens, start = 0, 0, 0
    for s in samples:
        n = len(s.tokens)
        rollout = decode_routed_experts(s.routed_experts, n, result["layers"], result["top_k"])
        same = torch.stack([(used[start : start + n - 1].sort(-1).values
                             == rollout[:, layer].long().sort(-1).values).all(-1)
                            for layer, used in result["used"].items()], dim=1)
        ok += int(same.all(-1).sum())
        tokens += n - 1
        start += n
    return ok / tokens


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3"])
def test_r3_on_new_moe_families(tmp_path, arch: str) -> None:
    path = make_tiny_hf_checkpoint(tmp_path / arch, arch, seed=5)
    with ServerProcess(path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/generate", json={
            "input_ids": PROMPTS, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}})
        assert r.status_code == 200, r.text
    samples = [Sample(0, i, tokens=p + o["output_ids"], response_length=len(o["output_ids"]), reward=float(i % 2),
                      routed_experts=o["meta_info"]["routed_experts"]) for i, (p, o) in enumerate(zip(PROMPTS, r.json()))]
    on = run_ranks(worker, 1, str(path), samples, True, timeout_s=300)[0]
    off = run_ranks(worker, 1, str(path), samples, False, timeout_s=300)[0]
    if arch == "deepseek_v3":
        assert 0 not in on["used"]  # first_k_dense_replace=1: layer 0 has no experts
    assert token_agreement(on, samples) == 1.0
    assert token_agreement(off, samples) < 1.0
    assert on["moved"] > 0.0
