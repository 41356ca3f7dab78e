"""The engine's GPU paths (Triton attention, fused ops, decode CUDA graphs, grouped-GEMM experts)
against the reference paths (torch attention, eager, per-expert loop) on the same device.

Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_engine_gpu_paths.py`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.server_args import ServerArgs
from milepost.engine.setup import build_engine
from milepost.testing.checkpoints import make_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5 + (7 * i + j) % 400 for j in range(n)] for i, n in enumerate((3, 17, 40, 65, 1, 23))]


def _full_logits(model, seq: list[int]) -> torch.Tensor:
    """Reference logits [len(seq), vocab] of one full sequence (varlen attention, torch ops)."""
    from milepost.models.attention import VarlenCausalAttention
    from milepost.models.base import ForwardContext

    x = torch.tensor(seq, device="cuda")
    with torch.no_grad():
        ctx = ForwardContext(attention=VarlenCausalAttention(torch.tensor([0, len(seq)])))
        return model.compute_logits(model.forward(x, torch.arange(len(seq), device="cuda"), ctx))


def _assert_same_or_tie(model, prompts, fast, ref, tol: float, relative: bool = False) -> None:
    """Greedy outputs equal; where they part, the two tokens' reference logits were a near-tie
    (|gap| < tol, or < tol * max |logit| when relative: kernels that sum in another order may
    flip such an argmax, nothing else)."""
    for ids, a, b in zip(prompts, fast, ref):
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        logits = _full_logits(model, ids + b[:k])[-1]
        gap = (logits[a[k]] - logits[b[k]]).abs().item()
        if relative:
            tol = tol * logits.abs().max().item()
        assert gap < tol, f"diverged at token {k} with a reference logit gap of {gap}"


def _run(engine, prompts, max_new: int, temperature: float, logprob: bool = False):
    outs: dict[int, dict] = {i: {"ids": [], "lp": []} for i in range(len(prompts))}
    left = [len(prompts)]
    done = threading.Event()

    def collector(i: int):
        def on_output(o) -> None:
            outs[i]["ids"] += o.new_token_ids
            outs[i]["lp"] += o.new_logprobs
            if o.finished:
                outs[i]["routed"] = o.routed_experts
                left[0] -= 1
                if left[0] == 0:
                    done.set()
        return on_output

    for i, ids in enumerate(prompts):
        engine.submit(Request(
            rid=str(i), prompt_ids=ids, on_output=collector(i), stop_ids=frozenset(),
            params=SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True,
                                  sampling_seed=i),
            return_logprob=logprob, return_routed_experts=True,
        ))
    assert done.wait(300), "generation did not finish"
    return [outs[i] for i in range(len(prompts))]


def _engine(path: Path, dtype: str, fast: bool, **kw):
    args = ServerArgs(model_path=path, device="cuda", dtype=dtype, page_size=16,
                      max_total_tokens=8192, chunked_prefill_size=64,
                      attention_backend="triton" if fast else "torch",
                      disable_cuda_graph=not fast, cuda_graph_max_bs=8, **kw).resolved()
    engine = build_engine(args)[0]
    engine.start()
    return engine


def test_graph_and_kernels_greedy_equals_reference_path(tmp_path: Path) -> None:
    """fp32 tiny Qwen3: Triton kernels + CUDA graphs give the torch/eager path's greedy tokens.

    chunked_prefill_size=64 splits the 65-token prompt (cached-prefix prefill) and mixes decodes
    into prefill steps; 6 requests decode through the graphs padded to size 8.
    """
    make_tiny_checkpoint(tmp_path, "qwen3")
    outs = {}
    for fast in (False, True):
        engine = _engine(tmp_path, "float32", fast)
        try:
            outs[fast] = [o["ids"] for o in _run(engine, PROMPTS, 24, 0.0)]
            if fast:
                assert engine.runner.graphs is not None and engine.runner.graphs.captured
            model = engine.runner.model
        finally:
            engine.close()
    _assert_same_or_tie(model, PROMPTS, outs[True], outs[False], 1e-4)


def test_bf16_logprobs_match_full_recompute(tmp_path: Path) -> None:
    """bf16, sampled at T=1 through the fast path; a full-sequence forward (varlen attention,
    torch ops) gives the same log-probs within bf16 tolerance."""
    make_tiny_checkpoint(tmp_path, "qwen3")
    engine = _engine(tmp_path, "bfloat16", True)
    try:
        outs = _run(engine, PROMPTS, 32, 1.0, logprob=True)
        model = engine.runner.model
    finally:
        engine.close()
    diffs = []
    for ids, out in zip(PROMPTS, outs):
        seq = ids + out["ids"]
        lp = torch.log_softmax(_full_logits(model, seq)[len(ids) - 1 : -1], dim=-1)
        ref = lp.gather(1, torch.tensor(out["ids"], device="cuda")[:, None])[:, 0].cpu()
        diffs.append((ref - torch.tensor(out["lp"])).abs())
    d = torch.cat(diffs)
    assert d.mean() < 0.02 and d.max() < 0.15, (d.mean().item(), d.max().item())


def test_moe_grouped_experts_and_graphs_record_routing(tmp_path: Path) -> None:
    """bf16 tiny Qwen3-MoE through grouped GEMMs + graphs: every token's routed experts are
    recorded, and greedy tokens equal the reference path's or part only at a near-tie (bf16 with a
    random router: a flipped expert moves logits by a few bf16 steps of their scale)."""
    import base64

    import numpy as np

    make_tiny_checkpoint(tmp_path, "qwen3_moe")
    res = {}
    for fast in (False, True):
        engine = _engine(tmp_path, "bfloat16", fast)
        try:
            res[fast] = _run(engine, PROMPTS, 16, 0.0)
            layers, top_k = engine.runner.model.num_layers, engine.runner.model.moe_top_k
            model = engine.runner.model
        finally:
            engine.close()
    for ids, out in zip(PROMPTS, res[True]):
        routed = np.frombuffer(base64.b64decode(out["routed"]), dtype=np.int32)
        routed = routed.reshape(len(ids) + len(out["ids"]) - 1, layers, top_k)
        assert routed.min() >= 0, "a token's experts were not recorded"
    _assert_same_or_tie(model, PROMPTS, [o["ids"] for o in res[True]],
                        [o["ids"] for o in res[False]], 0.05, relative=True)


def test_grouped_experts_match_loop_at_scale() -> None:
    from milepost.kernels.grouped_experts import grouped_expert_mlp
    from milepost.models.qwen3_moe import StackedExperts

    torch.manual_seed(0)
    experts = StackedExperts(32, 256, 128).cuda()
    with torch.no_grad():
        experts.w13.normal_(0, 0.05)
        experts.w2.normal_(0, 0.05)
    experts = experts.bfloat16()
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 32, (300, 4), device="cuda")
    ids[:, 0] = 3
    w = torch.rand(300, 4, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = experts(x, ids, w)  # no_grad: the loop
    with torch.inference_mode():
        got = grouped_expert_mlp(x, ids, w, experts.w13, experts.w2)
    rel = (got.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 1e-2, rel.item()
