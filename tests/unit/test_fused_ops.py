"""Fused Triton RMSNorm / q-k norm + RoPE / SiLU-mul against the torch ops of layers.py.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before importing triton).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
fused = importlib.import_module("milepost.kernels.fused_ops")

from milepost.models.layers import RMSNorm, apply_rotary

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rope_tables(t: int, dim: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.rand(t, dim // 2, generator=g) * 6
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_module(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    norm = norm.to(dtype).to(DEV)
    x = (torch.randn(5, 24, generator=g) * 3).to(dtype).to(DEV)
    with torch.no_grad():
        ref = norm(x)  # no_grad (not inference_mode): the torch path
    got = fused.rms_norm(x, norm.weight.detach(), 1e-6)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_equals_the_add_then_the_norm_kernel(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, generator=g).to(dtype).to(DEV)
    x = (torch.randn(6, 40, generator=g) * 3).to(dtype).to(DEV)
    r = torch.randn(6, 80, generator=g).to(dtype).to(DEV)[:, ::2]  # a strided residual
    h, y = fused.add_rms_norm(x, r, w, 1e-6)
    if DEV == "cpu" and dtype == torch.bfloat16:
        # Triton's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest, as torch does):
        # one bf16 step apart here; on CUDA the values are equal.
        torch.testing.assert_close(h, x + r, atol=0, rtol=2**-7)
        torch.testing.assert_close(y, fused.rms_norm(h, w, 1e-6), atol=0, rtol=0)
        return
    assert torch.equal(h, x + r)  # torch's add: fp32 sum rounded to the dtype
    assert torch.equal(y, fused.rms_norm(x + r, w, 1e-6))


@pytest.mark.parametrize("with_norm", [True, False])
def test_norm_rope_matches_torch(with_norm: bool) -> None:
    g = torch.Generator().manual_seed(1)
    t, heads, dim = 4, 3, 16
    x = torch.randn(t, heads, dim, generator=g)
    cos, sin = _rope_tables(t, dim, g)
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
        ref = apply_rotary(norm(x) if with_norm else x, cos, sin)
    got = fused.norm_rope(x.to(DEV), norm.weight.detach().to(DEV) if with_norm else None, 1e-6,
                          cos.to(DEV), sin.to(DEV))
    torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_silu_mul_matches_torch_on_strided_halves() -> None:
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 40, generator=g).to(DEV)
    gate, up = gate_up.chunk(2, dim=-1)  # row stride 40, like the fused gate/up projection
    torch.testing.assert_close(fused.silu_mul(gate, up), F.silu(gate) * up, atol=1e-6, rtol=1e-6)


def test_fused_residuals_give_the_same_hidden_states(monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU inference path of a tiny Qwen3 (kernels under the interpreter on CPU), with every
    # residual add inside the next RMSNorm kernel (DecoderLM.forward) and with the adds apart.
    from milepost.bench.models import shape_config
    from milepost.models import layers
    from milepost.models.attention import VarlenCausalAttention
    from milepost.models.base import ForwardContext
    from milepost.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(shape_config("tiny"), torch.float32, DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    monkeypatch.setattr(layers, "gpu_inference", lambda x: True)
    ids = torch.randint(0, model.vocab_size, (12,), device=DEV)
    pos = torch.cat([torch.arange(5), torch.arange(7)]).to(DEV)
    cu = torch.tensor([0, 5, 12], device=DEV)
    out = {}
    for fused_adds in (False, True):
        monkeypatch.setattr(layers.DecoderLayer, "fuse_residual_norm", fused_adds)
        assert layers.fused_residuals(model.model.layers, model.model.norm, ids[:, None].float()) == fused_adds
        with torch.no_grad():
            out[fused_adds] = model(ids, pos, ForwardContext(attention=VarlenCausalAttention(cu)))
    assert torch.equal(out[True], out[False])
