"""The kernel contract of `--true-on-policy`: one sequence, one trainer-shaped forward.

The engine samples with its own paged, batched kernels, then re-scores every finished sequence
with `sequence_logprobs` (the report's §5.3 "re-score with a prefill pass of the trainer's
shape"); the trainer, under the same flag, runs one micro-batch per sample through the same code
(`TokenScorer` over `VarlenCausalAttention` with one sequence, unfused projections, the torch
RMSNorm / RoPE / SwiGLU, the chunked log-softmax of `token_logprobs` with LOGPROB_CHUNK rows).
Nothing in it depends on what else was in the batch, so the two results are the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import CausalLM, ForwardContext
from milepost.train.logprobs import token_logprobs

# Rows per LM-head chunk on both sides: the head's GEMM is [chunk, hidden] x [hidden, vocab], and
# a BLAS may block a different M differently, so the chunk size is part of the contract.
LOGPROB_CHUNK = 1024


def sequence_logprobs(
    lm: CausalLM, tokens: Sequence[int] | torch.Tensor, response_length: int, temperature: float = 1.0,
) -> torch.Tensor:
    """log p(token) of the last `response_length` tokens of `tokens`, alone in its forward: [R] fp32.

    Runs under no_grad with inference mode switched off even when the caller (an engine step)
    has it on: on CUDA inference mode selects the engine's fused inference kernels, which the
    trainer does not run.
    """
    device = next(lm.parameters()).device
    ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    n = ids.numel()
    if not 1 <= response_length < n:
        raise ValueError(f"need 1 <= response_length ({response_length}) < sequence length ({n})")
    rows = torch.arange(n - response_length - 1, n - 1, dtype=torch.int64)
    targets = ids[rows + 1]
    with torch.inference_mode(False), torch.no_grad():
        ctx = ForwardContext(VarlenCausalAttention(torch.tensor([0, n], dtype=torch.int64)))
        hidden = lm(ids.to(device), torch.arange(n, dtype=torch.int64, device=device), ctx)
        logp, _ = token_logprobs(lm, hidden, rows.to(device), targets.to(device), temperature=temperature,
                                 chunk_size=LOGPROB_CHUNK, use_checkpoint=False)
    return logp.float().cpu()


def rescore_request(lm: CausalLM, req: object) -> None:
    """Engine side: replace a finished request's sampled log-probs by `sequence_logprobs`.

    `req` is an engine `Request` (prompt_ids, output_ids, params, output_logprobs). Greedy
    requests are scored at temperature 1, as the sampler reports them. Penalties, logit bias and
    grammar masks are not applied: the trainer scores the model's own distribution.
    """
    n_out = len(req.output_ids)
    if n_out == 0 or not req.prompt_ids:
        return
    temperature = 1.0 if req.params.greedy else req.params.temperature
    logp = sequence_logprobs(lm, [*req.prompt_ids, *req.output_ids], n_out, temperature)
    req.output_logprobs = logp.tolist()
