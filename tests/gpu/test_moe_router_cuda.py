"""The whole MoE router in one kernel (kernels/moe_router.route) on CUDA: its probabilities are
torch's softmax bit for bit, its experts torch's top-k (ties in id order), it replays in a CUDA
graph, and an engine serving with it records every token's experts and decodes the tokens the
torch router's engine decodes (or parts at a near-tie).

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_moe_router_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("experts,top_k", [(128, 8), (64, 6), (60, 4), (512, 10)])
@pytest.mark.parametrize("tokens", [1, 256, 3000])
def test_route_probabilities_are_torchs_softmax_bits(experts: int, top_k: int, tokens: int) -> None:
    from milepost.kernels.moe_router import route

    g = torch.Generator(device="cuda").manual_seed(tokens + experts)
    logits = (torch.randn(tokens, experts, device="cuda", generator=g) * 2).to(torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    p, ids = route(logits, top_k, False, torch.float32, None)
    assert torch.equal(p, probs.gather(1, ids))
    assert torch.equal(ids.sort(-1).values, torch.topk(probs, top_k, dim=-1).indices.sort(-1).values)
    w, ids2 = route(logits, top_k, True, torch.float32, None)
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(w, p / p.sum(-1, keepdim=True), rtol=4.8e-7, atol=0)  # sum orders differ


def test_route_replays_in_a_cuda_graph() -> None:
    from milepost.kernels.moe_router import route

    logits = torch.randn(256, 128, device="cuda").to(torch.bfloat16)
    rec = torch.full((256, 3, 8), -1, dtype=torch.int32, device="cuda")
    want_w, want_ids = route(logits, 8, True, torch.bfloat16, rec[:, 1])
    rec.fill_(-1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        route(logits, 8, True, torch.bfloat16, rec[:, 1])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = route(logits, 8, True, torch.bfloat16, rec[:, 1])
    rec.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, want_w) and torch.equal(ids, want_ids)
    assert torch.equal(rec[:, 1], want_ids.to(torch.int32)) and (rec[:, 0] == -1).all()


def test_engine_with_the_fused_router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 tiny Qwen3-MoE, decode in CUDA graphs, router "finish" (torch's softmax and top-k)
    against "fused": every token's experts recorded, greedy tokens equal or parted at a near-tie
    (within 0.1 of the max |logit|, as the fused experts' engine test allows)."""
    from test_engine_gpu_paths import PROMPTS, _assert_same_or_tie, _engine, _run
    from test_fused_moe_cuda import assert_every_token_routed

    from milepost.models.qwen3_moe import SparseMoeBlock
    from milepost.testing.checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, "qwen3_moe")
    res = {}
    for kernels in ("finish", "fused"):
        monkeypatch.setattr(SparseMoeBlock, "router_kernels", kernels)
        engine = _engine(tmp_path, "bfloat16", True)
        try:
            res[kernels] = _run(engine, PROMPTS, 16, 0.0)
            model = engine.runner.model
            layers, top_k = model.num_layers, model.moe_top_k
        finally:
            engine.close()
    assert_every_token_routed(PROMPTS, res["fused"], layers, top_k)
    _assert_same_or_tie(model, PROMPTS, [o["ids"] for o in res["fused"]],
                        [o["ids"] for o in res["finish"]], 0.1, relative=True)
