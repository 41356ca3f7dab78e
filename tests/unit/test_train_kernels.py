"""The fused training kernels (RMSNorm, RoPE, SiLU-and-mul, LM-head log-prob + entropy) on CPU.

Triton's interpreter (TRITON_INTERPRET=1, read when a kernel is defined) runs the kernels on CPU
tensors, so their forward and backward are checked here in fp32 against the torch reference path
(the code the trainer runs on CPU). It runs in a child process: the variable must be set before
the kernels' module is imported. The CUDA bf16 comparison is tests/gpu/test_kernels_train_cuda.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")


def _grads(fn, *inputs: torch.Tensor, seed: int = 0):
    """fn(*inputs) and the gradients of a fixed random projection of its outputs."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    outs = fn(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [x.grad for x in xs if x.requires_grad]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"{what}[{i}]: {m}")


def check_all() -> None:
    from milepost.kernels import fused_logprob, train_fused
    from milepost.models.layers import apply_rotary
    from milepost.models.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    # RMSNorm over rows of a wide vector (hidden) and many rows of a short one (per-head q/k norm);
    # row counts that leave partial tiles.
    for rows, dim in ((37, 96), (203, 16)):
        x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)

        def torch_norm(x, w):  # RMSNorm.forward in fp32 (its casts are no-ops)
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

        fo, fg = _grads(lambda x, w: train_fused.rms_norm(x, w, 1e-6), x, w)
        ro, rg = _grads(torch_norm, x, w)
        _close(fo + fg, ro + rg, f"rms_norm {rows}x{dim}")
    # RoPE: [T, heads, head_dim] with real cos/sin tables; 3 heads (not a power of two).
    cfg = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          max_position_embeddings=64)
    cos, sin = RotaryEmbedding(cfg, 32)(torch.arange(11) * 3, torch.float32)
    q = torch.randn(11, 3, 32, generator=g)
    fo, fg = _grads(lambda q: train_fused.apply_rotary(q, cos, sin), q)
    ro, rg = _grads(lambda q: apply_rotary(q, cos, sin), q)
    _close(fo + fg, ro + rg, "rope")
    # SiLU-and-mul over a size that is not a multiple of the block.
    gate, up = torch.randn(7, 300, generator=g) * 4, torch.randn(7, 300, generator=g)
    fo, fg = _grads(train_fused.silu_mul, gate, up)
    ro, rg = _grads(lambda a, b: F.silu(a) * b, gate, up)
    _close(fo + fg, ro + rg, "silu_mul")
    # Log-probs + entropy from hidden states and the head: two chunks (the second partial), a
    # vocabulary that is not a multiple of the kernel's block, temperature 0.7.
    hidden, weight = torch.randn(13, 24, generator=g), torch.randn(5000, 24, generator=g) * 0.5
    targets = torch.randint(0, 5000, (13,), generator=g)

    def reference(h, w):
        logp_all = torch.log_softmax((h @ w.t()) / 0.7, dim=-1)
        return logp_all.gather(1, targets[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)

    fo, fg = _grads(lambda h, w: fused_logprob.linear_token_logprobs(h, w, targets, 0.7, chunk_size=8), hidden, weight)
    ro, rg = _grads(reference, hidden, weight)
    _close(fo + fg, ro + rg, "linear_token_logprobs")
    print("kernels ok")


def test_fused_training_kernels_match_the_torch_path_in_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    code = "import tests.unit.test_train_kernels as t; t.check_all()"
    done = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "kernels ok" in done.stdout


def test_fused_training_is_off_unless_switched_on() -> None:
    """The engine and the CPU path keep the torch ops: the switch is per module and off by default."""
    from milepost.models.layers import RMSNorm, fused_training, set_fused_training

    norm = RMSNorm(8, 1e-6)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert not fused_training(norm, x)
    block = torch.nn.Sequential(norm, torch.nn.Linear(8, 8))
    assert set_fused_training(block, True) == 1 and norm.fused_train
    assert not fused_training(norm, x)  # a CPU tensor: never the kernels


def test_grouped_experts_with_backward_match_the_expert_loop() -> None:
    """The trainer's MoE path on CUDA (grouped GEMMs, differentiated by autograd) against the
    per-expert loop, in fp32 on CPU where torch's grouped GEMM also runs."""
    from milepost.kernels.grouped_experts import grouped_expert_mlp
    from milepost.models.qwen3_moe import StackedExperts

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch has no _grouped_mm")
    g = torch.Generator().manual_seed(0)
    experts = StackedExperts(num_experts=6, hidden=16, intermediate=8)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=g) * 0.3)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=g) * 0.3)
    x = torch.randn(23, 16, generator=g)
    ids = torch.rand(23, 6, generator=g).argsort(-1)[:, :2]  # expert 5 may get no token: an empty group
    ids[ids == 5] = 4
    ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 0] + 1) % 5, ids[:, 1])
    weights = torch.rand(23, 2, generator=g)

    def grouped(x, w):
        return grouped_expert_mlp(x, ids, w, experts.w13, experts.w2, act=lambda a, b: F.silu(a) * b)

    def loop(x, w):
        return experts(x, ids, w)

    results = []
    for fn in (grouped, loop):
        experts.zero_grad()
        out, grads = _grads(fn, x, weights)
        results.append(out + grads + [experts.w13.grad.clone(), experts.w2.grad.clone()])
    _close(results[0], results[1], "grouped experts")
