"""The trainer's CUDA fast path against its reference path (issue 15), within bf16 tolerance.

FlashAttention-2 varlen (one call per layer) vs one SDPA call per sequence: attention outputs and
gradients, then a whole model's token log-probs and parameter gradients; the FSDP trainer's
in-forward old log-probs vs the separate scoring pass; layer checkpointing vs none.
Run on the accelerator machine: `python -m pytest -q -m gpu tests/gpu/test_train_fast_cuda.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from milepost.kernels import varlen_flash
from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import ForwardContext
from milepost.models.registry import load_model
from milepost.testing.batches import random_train_batch
from milepost.testing.checkpoints import make_tiny_checkpoint
from milepost.testing.dist import run_ranks
from milepost.train.fsdp import FSDPBackend, TrainerSettings
from milepost.train.logprobs import pack, token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENS = [7, 1, 300, 64, 129]


def _reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(varlen_flash, "flash_varlen_supported", lambda q, k: False)


def _attend(q, k, v, cu):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = VarlenCausalAttention(cu).attend(0, q, k, v, 128**-0.5)
    weight = torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(1), device="cuda",
                         dtype=out.dtype)
    (out.float() * weight.float()).sum().backward()
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def test_flash_varlen_matches_per_sequence_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    t = sum(LENS)
    q, k, v = (torch.randn(t, h, 128, generator=g, device="cuda", dtype=torch.bfloat16) for h in (16, 8, 8))
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], device="cuda")
    assert varlen_flash.flash_varlen_supported(q, k)
    fast, fast_grads = _attend(q, k, v, cu)
    _reference(monkeypatch)
    ref, ref_grads = _attend(q, k, v, cu)
    torch.testing.assert_close(fast, ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(fast_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def _model_grads(path: Path):
    lm = load_model(path, torch.bfloat16, "cuda").train()
    lm.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 512, (n + 2,), generator=g) for n in LENS]
    b = pack(seqs, [n + 1 for n in LENS], "cuda")
    hidden = lm(b.input_ids, b.positions, ForwardContext(VarlenCausalAttention(b.cu_seqlens)))
    logp, ent = token_logprobs(lm, hidden, b.rows, b.targets)
    (logp.sum() + ent.sum()).backward()
    return logp.detach(), {n: p.grad.float() for n, p in lm.named_parameters()}


def test_model_logprobs_and_gradients_match_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False, hidden_size=256,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    fast_lp, fast_g = _model_grads(path)
    _reference(monkeypatch)
    ref_lp, ref_g = _model_grads(path)
    assert (fast_lp - ref_lp).abs().mean() < 2e-2  # bf16 compute, fp32 logits
    for name, grad in ref_g.items():
        rel = (fast_g[name] - grad).norm() / grad.norm().clamp_min(1e-6)
        assert rel < 5e-2, (name, float(rel))


def _train(rank: int, world: int, path: str, overrides: dict) -> dict:
    s = TrainerSettings(lr=1e-4, global_batch_size=8, max_tokens_per_micro_batch=64, device="cuda",
                        dtype="bfloat16", ratio_correction="tis", **overrides)
    backend = FSDPBackend.create(path, s)
    metrics = backend.train_step(random_train_batch(8, 3))
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
              for n, p in backend.policy.lm.named_parameters()}
    return {"metrics": metrics, "params": params}


@pytest.mark.parametrize("overrides", [{"separate_old_logprob_pass": True}, {"activation_checkpointing": "layer"},
                                       {"compile_layers": True}, {"fused_kernels": False}],
                         ids=["separate_pass", "layer_ckpt", "compile_layers", "no_fused_kernels"])
def test_fast_trainer_step_matches_the_reference_step(tmp_path: Path, overrides: dict) -> None:
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3", with_tokenizer=False))
    [fast] = run_ranks(_train, 1, path, {}, backend="nccl", timeout_s=300)
    [ref] = run_ranks(_train, 1, path, overrides, backend="nccl", timeout_s=300)
    # The same kernels on both sides agree to summation order; the torch ops round differently
    # (bf16), which the TIS weights exp(old - rollout) carry into the loss.
    rel = 3e-2 if "fused_kernels" in overrides else 1e-3
    for key in ("pg_loss", "entropy", "train_rollout_logprob_abs_diff", "rollout_ratio", "grad_norm"):
        assert fast["metrics"][key] == pytest.approx(ref["metrics"][key], rel=rel, abs=1e-4), key
    initial = load_model(path, torch.float32, "cpu")
    moved = torch.cat([(p - initial.get_parameter(n).detach()).abs().flatten() for n, p in ref["params"].items()])
    apart = torch.cat([(fast["params"][n] - p).abs().flatten() for n, p in ref["params"].items()])
    # Adam turns a near-zero gradient's sign into a full lr-sized step: compare means, not maxima
    assert apart.mean() < 0.05 * moved.mean(), (float(apart.mean()), float(moved.mean()))
