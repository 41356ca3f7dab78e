"""The MoE router's kernels (kernels/moe_router.py) against torch's ops, alone and inside a tiny
Qwen3-MoE forward (Triton's interpreter on CPU): the fused end gives the same weights and recorded
ids; the whole router in one kernel the same experts (ties in id order) and weights to rounding."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
router = importlib.import_module("milepost.kernels.moe_router")

from milepost.testing.hopper_compile import needs_ptxas, run_compiled  # noqa: E402

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


@pytest.mark.parametrize("experts,top_k,tokens", [(128, 8, 37), (60, 4, 9), (8, 2, 5), (512, 10, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_picks_torchs_experts_ties_in_id_order(experts: int, top_k: int, tokens: int,
                                                     renormalize: bool) -> None:
    g = torch.Generator().manual_seed(experts + tokens)
    logits = torch.randn(tokens, experts, generator=g).to(torch.bfloat16)  # bf16: ties are common
    logits[0, :3] = 9.0  # a three-way tie at the top of row 0
    probs = torch.softmax(logits.float(), dim=-1)
    rec = torch.full((tokens, 3, top_k), -1, dtype=torch.int32, device=DEV)
    w, ids = router.route(logits.to(DEV), top_k, renormalize, torch.float32, rec[:, 1, :])
    w, ids, rec = w.cpu(), ids.cpu(), rec.cpu()
    assert ids.dtype == torch.int64 and ids[0, :3].tolist() == [0, 1, 2][:top_k]
    want_w, _ = torch.topk(probs, top_k, dim=-1)
    picked = probs.gather(1, ids)
    torch.testing.assert_close(picked, want_w, rtol=1e-6, atol=0)  # the k largest, largest first
    tie = picked[:, 1:] == picked[:, :-1]
    assert (ids[:, 1:][tie] > ids[:, :-1][tie]).all()  # equal probabilities: lower id first
    for row in range(tokens):  # a tie at the k-th place goes to the lower ids
        kth = want_w[row, -1]
        left = ((probs[row] == kth).nonzero().flatten()[: (picked[row] == kth).sum()]).tolist()
        assert sorted(ids[row][picked[row] == kth].tolist()) == left
    want = picked / picked.sum(dim=-1, keepdim=True) if renormalize else picked
    torch.testing.assert_close(w, want, rtol=2e-6, atol=0)
    assert torch.equal(rec[:, 1, :], ids.to(torch.int32))
    assert (rec[:, 0] == -1).all() and (rec[:, 2] == -1).all()


def test_route_edges() -> None:
    logits = torch.randn(4, 16, device=DEV)
    w, ids = router.route(logits[:0], 2, True, torch.bfloat16, None)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    w, ids = router.route(logits.t().contiguous().t(), 2, True, torch.bfloat16, None)  # strided columns
    assert w.dtype == torch.bfloat16 and torch.equal(ids, torch.topk(logits, 2, dim=-1).indices)
    with pytest.raises(ValueError, match="1024"):
        router.route(torch.randn(2, 2048, device=DEV), 2, True, torch.float32, None)
    with pytest.raises(ValueError, match="record must be"):
        router.route(logits, 2, True, torch.float32, torch.zeros(4, 3, dtype=torch.int32, device=DEV))


def test_moe_forward_with_the_router_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
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
    for kernels in ("torch", "finish", "fused"):
        monkeypatch.setattr(qwen3_moe.SparseMoeBlock, "router_kernels", kernels)
        rec[kernels] = torch.full((9, 2, 2), -1, dtype=torch.int32, device=DEV)
        ctx = ForwardContext(attention=VarlenCausalAttention(torch.tensor([0, 9], device=DEV)),
                             routed_experts=rec[kernels])
        with torch.no_grad():
            out[kernels] = model(ids, pos, ctx)
    assert torch.equal(out["finish"], out["torch"])
    assert torch.equal(rec["finish"], rec["torch"]) and (rec["torch"] >= 0).all()
    # one kernel: the same experts (fp32 logits: no ties here), weights equal to rounding
    assert torch.equal(rec["fused"], rec["torch"])
    torch.testing.assert_close(out["fused"], out["torch"], rtol=1e-5, atol=1e-6)


_COMPILE_ROUTE = """
import triton
from milepost.kernels import moe_router
from milepost.testing.hopper_compile import compile_sm90
ptrs = {"LOGITS": "*bf16", "OUT_W": "*bf16", "IDS": "*i64", "REC": "*i32"}
for experts, top_k, block_t, warps in ((128, 8, 2, 1), (60, 4, 4, 1), (512, 10, 1, 4), (16, 2, 16, 2)):
    e_pad = triton.next_power_of_2(experts)
    lanes = min(e_pad, 32)
    c = {"E": experts, "LANES": lanes, "LOG_LANES": lanes.bit_length() - 1, "ITERS": e_pad // lanes,
         "K": top_k, "K_PAD": triton.next_power_of_2(top_k), "BLOCK_T": block_t, "NORM": True,
         "RECORD": True, "LIBDEVICE_EXP": True}
    assert compile_sm90(moe_router._route_kernel, ptrs, c, warps, 3).asm["cubin"], (experts, top_k)
"""


@needs_ptxas()
def test_route_kernel_compiles_for_sm90() -> None:
    """The interpreter never lowers the kernel (libdevice's expf, the lane butterfly's reshapes):
    compile it for an H100/H200 here (Triton's bundled ptxas, no GPU)."""
    run_compiled(_COMPILE_ROUTE)
