"""The fused training kernels on CUDA in bf16 against the torch path (issue 15), then a whole model.

Each kernel (RMSNorm, RoPE, SiLU-and-mul, LM-head log-prob + entropy) at Qwen3-0.6B sizes:
outputs and input gradients within bf16 tolerance of the torch ops the trainer runs without them;
then a tiny Qwen3's token log-probs and every parameter gradient with the kernels on vs off.
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_kernels_train_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from milepost.kernels import fused_logprob, train_fused
from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import ForwardContext
from milepost.models.layers import apply_rotary, set_fused_training
from milepost.models.registry import load_model
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.train.logprobs import pack, token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BF16 = torch.bfloat16


def _run(fn, *inputs: torch.Tensor):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator("cuda").manual_seed(1)
    sum((o.float() * torch.randn(o.shape, generator=g, device="cuda")).sum() for o in outs).backward()
    return [o.detach().float() for o in outs] + [x.grad.float() for x in xs if x.requires_grad]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _compare(fast, ref, tol: float = 1e-2) -> None:
    for i, (a, b) in enumerate(zip(_run(*fast), _run(*ref))):
        assert a.shape == b.shape and _rel(a, b) < tol, (i, _rel(a, b))


def _g() -> torch.Generator:
    return torch.Generator("cuda").manual_seed(0)


@pytest.mark.parametrize("rows,dim", [(4099, 1024), (4099 * 16, 128)])
def test_rms_norm(rows: int, dim: int) -> None:
    x = torch.randn(rows, dim, generator=_g(), device="cuda", dtype=BF16) * 2
    w = (1 + 0.1 * torch.randn(dim, generator=_g(), device="cuda")).to(BF16)

    def ref(x, w):  # milepost.models.layers.RMSNorm.forward
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    _compare((lambda x, w: train_fused.rms_norm(x, w, 1e-6), x, w), (ref, x, w))


def test_rope() -> None:
    t = 3000
    q = torch.randn(t, 16, 128, generator=_g(), device="cuda", dtype=BF16)
    freqs = torch.arange(t, device="cuda").float()[:, None] * (1e6 ** -(torch.arange(64, device="cuda") / 64))
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    _compare((lambda q: train_fused.apply_rotary(q, cos, sin), q), (lambda q: apply_rotary(q, cos, sin), q))


def test_silu_mul() -> None:
    gate, up = (torch.randn(4099, 3072, generator=_g(), device="cuda", dtype=BF16) * 3 for _ in range(2))
    _compare((train_fused.silu_mul, gate, up), (lambda a, b: F.silu(a) * b, gate, up))


def test_linear_token_logprobs() -> None:
    n, hidden, vocab = 700, 1024, 151936
    h = torch.randn(n, hidden, generator=_g(), device="cuda", dtype=BF16)
    w = (torch.randn(vocab, hidden, generator=_g(), device="cuda") * 0.05).to(BF16)
    targets = torch.randint(0, vocab, (n,), generator=_g(), device="cuda")

    def ref(h, w):  # milepost.train.logprobs._chunk, whole
        logp_all = torch.log_softmax((h @ w.t()).float() / 0.8, dim=-1)
        return logp_all.gather(1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)

    fast = (lambda h, w: fused_logprob.linear_token_logprobs(h, w, targets, 0.8, chunk_size=256), h, w)
    _compare(fast, (ref, h, w), tol=2e-2)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fused_logprob.linear_token_logprobs(h, w, targets, 0.8, chunk_size=256)
    # only one [chunk, vocab] bf16 block at a time: far below one fp32 [n, vocab] tensor
    assert torch.cuda.max_memory_allocated() - base < 0.5 * n * vocab * 4


def _model(path: Path, fused: bool, forced: bool = False):
    lm = load_model(path, BF16, "cuda").train()
    lm.requires_grad_(True)
    set_fused_training(lm, fused)
    g = torch.Generator().manual_seed(0)
    lens = [7, 1, 300, 64, 129]
    b = pack([torch.randint(3, 512, (n + 2,), generator=g) for n in lens], [n + 1 for n in lens], "cuda")
    experts = None
    if forced:  # the same experts on both sides: a near-tie in the router flips with bf16 rounding
        scores = torch.rand(b.num_tokens, lm.num_layers, lm.num_experts, generator=g)
        experts = scores.argsort(-1)[..., : lm.moe_top_k].to("cuda")
    ctx = ForwardContext(VarlenCausalAttention(b.cu_seqlens), forced_experts=experts)
    hidden = lm(b.input_ids, b.positions, ctx)
    logp, ent = token_logprobs(lm, hidden, b.rows, b.targets, fused=fused, chunk_size=128)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), ent.detach(), {n: p.grad.float() for n, p in lm.named_parameters()}


def test_model_with_fused_kernels_matches_the_torch_ops(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False, hidden_size=256,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    fast_lp, fast_ent, fast_g = _model(path, True)
    ref_lp, ref_ent, ref_g = _model(path, False)
    assert (fast_lp - ref_lp).abs().mean() < 2e-2
    assert (fast_ent - ref_ent).abs().mean() < 2e-2
    for name, grad in ref_g.items():
        assert _rel(fast_g[name], grad) < 5e-2, (name, _rel(fast_g[name], grad))


def test_moe_model_with_grouped_experts_matches_the_expert_loop(tmp_path: Path) -> None:
    """Training a Qwen3-MoE: grouped GEMMs (with backward) + fused kernels vs the per-expert loop."""
    path = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False)
    fast_lp, _, fast_g = _model(path, True, forced=True)
    ref_lp, _, ref_g = _model(path, False, forced=True)
    assert (fast_lp - ref_lp).abs().mean() < 2e-2
    for name, grad in ref_g.items():
        assert _rel(fast_g[name], grad) < 5e-2, (name, _rel(fast_g[name], grad))
