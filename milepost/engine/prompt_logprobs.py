"""Prompt log-probs (SGLang's `input_token_logprobs`), taken from the prefill's own logits.

A request asking for them (`logprob_start_len` >= 0 with `return_logprob`) gets the logits of
every prompt position from `logprob_start_len - 1` on (the scheduler never reuses a cached prefix
past that point, so each value comes from this forward pass, not from a cache). Values are
`log_softmax(logits / temperature)` in fp32 (temperature 1 for greedy requests), the same
distribution as the output log-probs; penalties and `logit_bias` act on sampling only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from milepost.engine.request import Request
from milepost.engine.scheduler import Chunk


def take_prompt_logprobs(chunks: Sequence[Chunk], logits: torch.Tensor) -> torch.Tensor:
    """Record the prompt log-probs in `logits` (rows laid out as forward_batch._logit_rows) on
    their requests; return the rows of the chunks that sample, in chunk order."""
    if all(c.req.logprob_start_len < 0 for c in chunks):  # the common step: nothing to score
        return logits
    spans = [(c, c.prompt_rows) for c in chunks]  # before recording moves prompt_lp_next
    if not any(rows for _, rows in spans):
        return logits
    keep: list[int] = []
    off = 0
    for c, rows in spans:
        if rows:
            _record(c.req, rows, logits[off : off + len(rows)])
            off += len(rows)
        if c.samples:  # a speculative verify chunk returns a row per proposed token, plus one
            keep.extend(range(off, off + c.logit_rows))
            off += c.logit_rows
    if off != logits.shape[0]:
        raise RuntimeError(f"the forward returned {logits.shape[0]} logit rows, expected {off}")
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]


def _record(req: Request, positions: range, logits: torch.Tensor) -> None:
    """logits: [k, V], row j scores prompt token positions[j] + 1."""
    p = req.params
    scaled = logits.float()
    if not p.greedy and p.temperature != 1.0:
        scaled = scaled / p.temperature
    lp = torch.log_softmax(scaled, dim=-1)  # [k, V]
    targets = torch.tensor(req.prompt_ids[positions.start + 1 : positions.stop + 1],
                           dtype=torch.long, device=lp.device)
    req.input_logprobs.extend(lp.gather(1, targets[:, None]).squeeze(1).tolist())
    if req.top_logprobs_num > 0:
        vals, ids = lp.topk(min(req.top_logprobs_num, lp.shape[1]), dim=-1)
        req.input_top_logprobs.extend(
            list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist()))
    if req.token_ids_logprob:
        cols = torch.tensor(req.token_ids_logprob, dtype=torch.long, device=lp.device)
        req.input_ids_logprobs.extend(lp.index_select(1, cols).tolist())
