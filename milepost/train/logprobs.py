"""Token log-probs of packed sequences: packing, micro-batch planning, chunked LM head.

Sequences are concatenated without padding and attend within themselves (`VarlenCausalAttention`).
The LM head, log_softmax, gather and entropy run over chunks of tokens, each under activation
checkpointing when gradients are on, so fp32 logits [T, vocab] are never materialized whole: only
[chunk, vocab] lives at a time, in forward and in the recompute during backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from milepost.models.attention import VarlenCausalAttention
from milepost.models.base import CausalLM, ForwardContext
from milepost.models.layers import set_fused_training
from milepost.models.llama import DecoderLM


@dataclass
class PackedBatch:
    """Several sequences as one flat batch.

    input_ids, positions: [T] int64; cu_seqlens: [B+1] int64 sequence bounds.
    rows: [N] int64, the hidden rows whose next token is a response token; targets: [N] those tokens.
    response_lengths: per sequence, how many of the N rows are its (in order).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    response_lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pack(tokens: Sequence[torch.Tensor], response_lengths: Sequence[int], device: torch.device | str) -> PackedBatch:
    """Pack sequences (each [len] int64, the last response_lengths[i] tokens scored) onto `device`."""
    if not tokens:
        raise ValueError("pack needs at least one sequence")
    ids, pos, rows, cu = [], [], [], [0]
    for tok, r in zip(tokens, response_lengths):
        n = tok.numel()
        if not 1 <= r < n:
            raise ValueError(f"need 1 <= response_length ({r}) < sequence length ({n})")
        start = cu[-1]
        ids.append(tok.reshape(-1).to(torch.int64))
        pos.append(torch.arange(n, dtype=torch.int64))
        rows.append(torch.arange(start + n - r - 1, start + n - 1, dtype=torch.int64))  # row j predicts token j+1
        cu.append(start + n)
    input_ids = torch.cat(ids)
    rows_t = torch.cat(rows)
    return PackedBatch(
        input_ids=input_ids.to(device),
        positions=torch.cat(pos).to(device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device),
        rows=rows_t.to(device),
        targets=input_ids[rows_t + 1].to(device),
        response_lengths=list(response_lengths),
    )


def dummy_batch(device: torch.device | str) -> PackedBatch:
    """A 2-token sequence scoring one token: run (with zero loss weight) by a rank that has no data
    for a micro-batch its peers run, so every rank issues the same collectives."""
    return pack([torch.zeros(2, dtype=torch.int64)], [1], device)


def _chunk(lm: CausalLM, hidden: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = lm.compute_logits(hidden)  # [c, V] fp32
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _plain_head(lm: CausalLM, hidden: torch.Tensor) -> bool:
    """The model's logits are exactly lm_head(hidden) (no soft-cap, scale or bias) and the fused
    kernels can run on hidden (CUDA, the head's half-precision dtype)."""
    head = getattr(lm, "lm_head", None)
    return (isinstance(lm, DecoderLM) and type(lm).compute_logits is DecoderLM.compute_logits
            and isinstance(head, nn.Linear) and head.bias is None and hidden.is_cuda
            and hidden.dtype in (torch.bfloat16, torch.float16) and head.weight.dtype == hidden.dtype)


def token_logprobs(
    lm: CausalLM,
    hidden: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    use_checkpoint: bool | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the entropy of the next-token distribution at hidden[rows]: both [N] fp32.

    use_checkpoint: recompute each chunk's logits in backward (default: when grad is enabled).
    fused: on CUDA bf16/fp16 with a plain LM head, the Triton kernels of
    milepost/kernels/fused_logprob.py (no fp32 [chunk, vocab] tensors, no autograd recompute).
    The rows are gathered once and cut with `split` (one gradient node for all chunks; slicing per
    chunk would give each chunk a full-size gradient buffer to fill and sum).
    """
    if use_checkpoint is None:
        use_checkpoint = torch.is_grad_enabled()
    if rows.numel() == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    logps, ents = [], []
    selected = hidden.index_select(0, rows)  # [N, hidden]
    if fused and _plain_head(lm, selected):
        from milepost.kernels.fused_logprob import linear_token_logprobs

        return linear_token_logprobs(selected, lm.lm_head.weight, targets, temperature, chunk_size)
    for h, t in zip(selected.split(chunk_size), targets.split(chunk_size)):
        args = (lm, h, t, temperature)
        lp, ent = checkpoint(_chunk, *args, use_reentrant=False) if use_checkpoint else _chunk(*args)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents)  # a fresh tensor, not a view (FSDP hooks the output)


class TokenScorer(nn.Module):
    """The trained module: a native LM whose forward returns token log-probs and entropies.

    Wrapping the LM makes the LM head part of one forward call, so FSDP's root module gathers its
    weights for the chunks (and for their recompute in backward) like any other parameter.
    """

    def __init__(self, lm: CausalLM, temperature: float = 1.0, chunk_size: int = 1024,
                 fused: bool = False) -> None:
        """fused: the fused CUDA kernels for the model's norms, RoPE, SwiGLU and the log-prob head."""
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.fused = fused
        if fused:
            set_fused_training(lm, True)
        # --enable-mtp-training (train/mtp.py): the MTP layer's cross-entropy of each training
        # forward, for the step to add to its loss; None when off or without grad.
        self.mtp_training = False
        self.mtp_out = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        rows: torch.Tensor,
        targets: torch.Tensor,
        forced_experts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed batch fields -> (logp [N], entropy [N]) fp32. forced_experts: [T, layers, top_k]
        expert ids for MoE layers to use instead of their router's top-k (routing replay)."""
        ctx = ForwardContext(VarlenCausalAttention(cu_seqlens), forced_experts=forced_experts)
        hidden = self.lm(input_ids, positions, ctx)
        if self.mtp_training and torch.is_grad_enabled():
            from milepost.train.mtp import mtp_cross_entropy

            self.mtp_out = mtp_cross_entropy(self.lm, hidden, input_ids, positions, cu_seqlens, rows,
                                             targets, self.chunk_size)
        return token_logprobs(
            self.lm, hidden, rows, targets, temperature=self.temperature, chunk_size=self.chunk_size,
            fused=self.fused,
        )

    def score(self, batch: PackedBatch, forced_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self(batch.input_ids, batch.positions, batch.cu_seqlens, batch.rows, batch.targets, forced_experts)


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, count: int | None = None) -> list[list[int]]:
    """Group sample indices into micro-batches of at most `max_tokens` tokens, balanced by tokens.

    Longest first, each sample goes into the first micro-batch it fits (first-fit decreasing), so
    short samples fill the gaps long ones leave and there are as few forward/backward passes as
    the budget allows; indices inside a micro-batch are in ascending order. A sample longer than
    the budget forms a micro-batch alone. With `count` (>= the natural number), the largest
    splittable micro-batches are halved, then empty ones appended, until there are exactly
    `count` -- so ranks with less data issue as many forward/backward passes as their peers.
    """
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        n = lengths[i]
        at = next((b for b, u in enumerate(used) if u + n <= max_tokens), None)
        if at is None:
            bins.append([i])
            used.append(n)
        else:
            bins[at].append(i)
            used[at] += n
    bins = [sorted(b) for b in bins]
    if count is None:
        return bins
    if count < len(bins):
        raise ValueError(f"cannot fit {len(lengths)} samples into {count} micro-batches (need {len(bins)})")
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        big = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        at = bins.index(big)
        half, acc = 1, lengths[big[0]]
        total = sum(lengths[i] for i in big)
        while half < len(big) - 1 and acc + lengths[big[half]] <= total / 2:
            acc += lengths[big[half]]
            half += 1
        bins[at : at + 1] = [big[:half], big[half:]]
    return bins
