"""The per-row sampler issue 2 built, frozen as the reference the fast batched sampler must match.

Used by tests (same tokens, same log-probs on mixed batches) and by benchmarks/sampling_speed.py
(old vs new in one run). Not used by the engine.
"""

from __future__ import annotations

import torch

from milepost.engine.sampling import SampleResult, SamplingParams


def reference_sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]],
    top_logprobs_num: int = 0,
) -> SampleResult:
    """logits: [B, V] -> one token per row, drawing row by row (one multinomial per row)."""
    logits = logits.float()
    if any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, ids] = float("-inf")
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
    logprobs_all = torch.log_softmax(logits / temps[:, None], dim=-1)  # [B, V]

    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens[greedy] = logits[greedy].argmax(dim=-1)
    for i in (i for i, p in enumerate(params) if not p.greedy):
        tokens[i] = _sample_row(logprobs_all[i], params[i], generators[i])

    chosen = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    top_ids = top_lp = None
    if top_logprobs_num > 0:
        top_lp, top_ids = logprobs_all.topk(min(top_logprobs_num, logits.shape[-1]), dim=-1)
    return SampleResult(tokens, chosen, top_ids, top_lp)


def _sample_row(
    logprobs: torch.Tensor, p: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Draw one token from exp(logprobs) after the row's truncations; logprobs: [V]."""
    probs = logprobs.exp()
    if 0 < p.top_k < probs.shape[0]:
        kth = probs.topk(p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[mass_before >= p.top_p * sorted_probs.sum()] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
