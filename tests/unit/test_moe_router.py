"""The fused end of the MoE router (kernels/moe_router.py) against torch's ops: the same weights and
recorded ids, alone and inside a tiny Qwen3-MoE forward (Triton's interpreter on CPU)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
router = importlib.import_module("milepost.kernels.moe_router")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finish_routing_equals_torch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(37, 16, generator=g), dim=-1).to(DEV)
    w, ids = torch.topk(probs, 4, dim=-1)
    s = w.sum(dim=-1, keepdim=True)
    rec = torch.full((37, 3, 4), -1, dtype=torch.int32, device=DEV)
    got = router.finish_routing(w, s, ids, dtype, rec[:, 1, :])
    want = (w / s).to(dtype)
    if DEV == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, want)
    assert torch.equal(rec[:, 1, :], ids.to(torch.int32))
    assert (rec[:, 0] == -1).all() and (rec[:, 2] == -1).all()
    assert torch.equal(router.finish_routing(w, None, ids, torch.float32, None), w)


def test_moe_forward_with_the_fused_router_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import Qwen3MoeConfig

    from milepost.models import layers, qwen3_moe
    from milepost.models.attention import VarlenCausalAttention
    from milepost.models.base import ForwardContext
    from milepost.models.registry import build_model

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    model = build_model(cfg, torch.float32, DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    # the GPU inference path's choices (fused kernels under the interpreter on CPU)
    monkeypatch.setattr(layers, "gpu_inference", lambda x: True)
    monkeypatch.setattr(qwen3_moe, "gpu_inference", lambda x: True)
    ids = torch.randint(0, 64, (9,), device=DEV)
    pos = torch.arange(9, device=DEV)
    out, rec = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(qwen3_moe.SparseMoeBlock, "fused_router", fused)
        rec[fused] = torch.full((9, 2, 2), -1, dtype=torch.int32, device=DEV)
        ctx = ForwardContext(attention=VarlenCausalAttention(torch.tensor([0, 9], device=DEV)),
                             routed_experts=rec[fused])
        with torch.no_grad():
            out[fused] = model(ids, pos, ctx)
    assert torch.equal(out[True], out[False])
    assert torch.equal(rec[True], rec[False]) and (rec[True] >= 0).all()
