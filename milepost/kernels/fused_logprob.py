"""Log-probs and entropy of sampled tokens straight from hidden states and the LM head (Triton).

The torch path (milepost/train/logprobs.py) runs, per chunk of rows, the LM head, an fp32 cast,
log_softmax, gather, exp, a product and a sum, and recomputes all of it under autograd in
backward: several [chunk, vocab] fp32 tensors per chunk. Here a chunk's logits stay in the model
dtype ([chunk, vocab] bf16, as the LM head returns them); one kernel reads each row once (online
log-sum-exp) for log p(target) and the entropy. Backward recomputes the chunk's logits, one
kernel overwrites them in place with d(loss)/d(logits), and two GEMMs give d(hidden) and
d(weight) (summed over chunks in fp32). Statistics are fp32; logits / temperature as the
reference divides them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _stats(Z, TGT, LOGP, LSE, ENT, n_vocab, stride_z, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    t = tl.zeros((), dtype=tl.float32)  # sum exp(z - m) * z, rescaled with m like s
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, 0))
        scale = tl.exp(m - m_new)
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        s = s * scale + tl.sum(e, 0)
        t = t * scale + tl.sum(tl.where(mask, e * z, 0.0), 0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(TGT + row)
    zt = tl.load(base + target).to(tl.float32) / temperature
    tl.store(LOGP + row, zt - lse)
    tl.store(LSE + row, lse)
    tl.store(ENT + row, lse - t / s)


@triton.jit
def _grad(Z, TGT, LSE, ENT, DLOGP, DENT, n_vocab, stride_z, temperature, BLOCK: tl.constexpr):
    """z <- d/dz of (dlogp * logp + dent * entropy), in place (z: the unscaled logits)."""
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    lse = tl.load(LSE + row)
    ent = tl.load(ENT + row)
    dlogp = tl.load(DLOGP + row)
    dent = tl.load(DENT + row)
    target = tl.load(TGT + row)
    for start in range(0, n_vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_vocab
        logp = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) / temperature - lse
        p = tl.exp(logp)
        # d logp_target / dz = onehot - p ; d entropy / dz = -p * (logp + entropy)
        dz = dlogp * (tl.where(cols == target, 1.0, 0.0) - p) - dent * p * (logp + ent)
        tl.store(base + cols, (dz / temperature).to(Z.dtype.element_ty), mask=mask)


class _LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):  # type: ignore[override]
        n = hidden.shape[0]
        vocab = weight.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, ent = torch.empty_like(logp), torch.empty_like(logp)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            z = hidden[a:b] @ weight.t()  # [c, V] in the model dtype
            _stats[(b - a,)](z, targets[a:b], logp[a:b], lse[a:b], ent[a:b], vocab, z.stride(0),
                             temperature, BLOCK=_BLOCK)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp, ent

    @staticmethod
    def backward(ctx, dlogp, dent):  # type: ignore[override]
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        n, vocab = hidden.shape[0], weight.shape[0]
        dlogp = torch.zeros_like(lse) if dlogp is None else dlogp.float().contiguous()
        dent = torch.zeros_like(lse) if dent is None else dent.float().contiguous()
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for a in range(0, n, ctx.chunk):
            b = min(n, a + ctx.chunk)
            z = hidden[a:b] @ weight.t()  # recomputed: [c, V] in the model dtype, becomes dz
            _grad[(b - a,)](z, targets[a:b], lse[a:b], ent[a:b], dlogp[a:b], dent[a:b], vocab, z.stride(0),
                            ctx.temperature, BLOCK=_BLOCK)
            if dh is not None:
                torch.matmul(z, weight, out=dh[a:b])
            if dw is not None:
                dw += z.t() @ hidden[a:b]
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden: [N, H], weight: [V, H] (the LM head, same dtype), targets: [N] int64 ->
    (log p(targets), entropy), both [N] fp32, of softmax(hidden @ weight.T / temperature)."""
    if hidden.dtype != weight.dtype:
        raise ValueError(f"linear_token_logprobs: hidden is {hidden.dtype} but the LM head weight is {weight.dtype}")
    return _LinearLogprob.apply(hidden.contiguous(), weight, targets.contiguous(), float(temperature), int(chunk_size))
