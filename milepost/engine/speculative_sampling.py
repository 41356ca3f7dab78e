"""The speculative verifier: accept proposed tokens so that every output follows the target exactly.

The standard rejection-sampling rule (Leviathan et al. 2023; Chen et al. 2023): a token d proposed
with draft probability p(d) is accepted with probability min(1, q(d) / p(d)), q the target's
sampling distribution at that position (temperature, then top-k / min-p / top-p, as sample() in
sampling.py); at the first rejection one token is drawn from max(q - p, 0), normalized, and the
step ends; when all are accepted one more is drawn from q at the last row. An n-gram proposal is
a point mass (p(d) = 1): accept with probability q(d), else draw from q without d. Greedy rows
accept while the proposal is the argmax, then add the argmax: the plain greedy tokens exactly.
Reported log-probs are the target's `log_softmax(logits / T)` at each token (sampling.py's rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from milepost.engine.sampling import _on_device, _race, _truncate
from milepost.engine.sampling_params import SamplingParams


@dataclass
class Verdict:
    """Per request: the accepted proposals then one token the target drew; and where they came from."""

    tokens: list[list[int]]  # [request][m + 1]
    logprobs: list[list[float]]  # the target's log-prob of each token
    rows: list[list[int]]  # the logits row that scored each token (top log-probs read them)
    accepted: list[int]  # m: proposals accepted
    logprobs_all: torch.Tensor  # [rows, V] log_softmax(logits / T): every row of the step


def verify(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> Verdict:
    """logits: [sum(k_i + 1), V], request i's rows in order: row j is the target's distribution for
    the token after proposal j (row 0: after the last accepted token). drafts[i]: the k_i proposed
    ids; draft_probs[i]: [k_i, V] the normalized distributions they were drawn from, or None for a
    point mass (n-gram). Batched over requests; two host reads (accept flags, then the tokens)."""
    logits = logits.float()
    dev = logits.device
    counts = [len(d) + 1 for d in drafts]
    starts = [0] * len(counts)
    for i in range(1, len(counts)):
        starts[i] = starts[i - 1] + counts[i - 1]
    row_params = [p for p, n in zip(params, counts) for _ in range(n)]
    temps = [1.0 if p.greedy else p.temperature for p in row_params]
    scaled = logits
    if any(t != 1.0 for t in temps):
        scaled = logits / _on_device(temps, dev)[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)  # [R, V]
    argmax = logits.argmax(dim=-1)  # [R]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    # q: [rows of sampled requests, V] the target's sampling distribution; q_at[r]: row r's
    # index in q (0 for greedy rows, whose q is never read: they compare with the argmax).
    q = q_at = None
    if sampled:
        rows = [starts[i] + j for i in sampled for j in range(counts[i])]
        q = logprobs_all[rows].exp() if len(sampled) < len(params) else logprobs_all.exp()
        _truncate(q, [row_params[r] for r in rows])
        q /= q.sum(dim=1, keepdim=True)
        at = [0] * len(row_params)
        for n, r in enumerate(rows):
            at[r] = n
        q_at = _on_device(at, dev)

    # Every proposal's test at once; each request's first rejection is found on the host.
    flags = _accept_flags(q, q_at, argmax, drafts, draft_probs, params, generators, starts, dev)
    accepted = []
    for i, d in enumerate(drafts):
        m = 0
        while m < len(d) and flags[i][m]:
            m += 1
        accepted.append(m)

    # One token drawn at row starts[i] + m: greedy argmax, else q there, or after a rejection
    # the residual max(q - p, 0) (a point mass p: q without the rejected token).
    last = _on_device([starts[i] + m for i, m in enumerate(accepted)], dev)
    final = argmax[last]
    if sampled:
        dist = q[q_at[last[_on_device(sampled, dev)]]]  # [S, V]
        _residuals(dist, sampled, drafts, draft_probs, accepted, dev)
        final[_on_device(sampled, dev)] = _race(dist, [generators[i] for i in sampled])
    final_host = final.tolist()

    tokens, out_rows = [], []
    for i, d in enumerate(drafts):
        m = accepted[i]
        tokens.append(list(d[:m]) + [final_host[i]])
        out_rows.append(list(range(starts[i], starts[i] + m + 1)))
    flat_rows = [r for rs in out_rows for r in rs]
    flat_tok = [t for ts in tokens for t in ts]
    lp = logprobs_all[_on_device(flat_rows, dev), _on_device(flat_tok, dev)].tolist()
    logprobs, off = [], 0
    for ts in tokens:
        logprobs.append(lp[off : off + len(ts)])
        off += len(ts)
    return Verdict(tokens, logprobs, out_rows, accepted, logprobs_all)


def _accept_flags(q: torch.Tensor | None, q_at: torch.Tensor | None, argmax: torch.Tensor,
                  drafts: Sequence[Sequence[int]],
                  draft_probs: Sequence[torch.Tensor | None], params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None], starts: list[int],
                  dev: torch.device) -> list[list[bool]]:
    """flags[i][j]: proposal j of request i passes its own test (only a prefix of them counts)."""
    rows = [starts[i] + j for i, d in enumerate(drafts) for j in range(len(d))]
    if not rows:
        return [[] for _ in drafts]
    toks = _on_device([t for d in drafts for t in d], dev)
    rows_t = _on_device(rows, dev)
    ok = argmax[rows_t] == toks
    if q is not None:
        target = q[q_at[rows_t], toks]  # q(d) (read on greedy rows too, then not used)
        proposal = torch.ones_like(target)  # p(d): 1 for a point mass
        with_p = [i for i, (d, p) in enumerate(zip(drafts, draft_probs)) if p is not None and len(d)]
        if with_p:
            at = _on_device([starts[i] - i + j for i in with_p for j in range(len(drafts[i]))], dev)
            p_all = torch.cat([draft_probs[i][: len(drafts[i])] for i in with_p])  # [n, V]
            proposal[at] = p_all.gather(1, toks[at][:, None]).squeeze(1)
        u = _uniforms(len(rows), drafts, params, generators, dev)
        is_greedy = _on_device([params[i].greedy for i, d in enumerate(drafts) for _ in d], dev)
        # u < q/p, written u * p < q: no division by a p that underflowed to 0.
        ok = torch.where(is_greedy, ok, u * proposal < target)
    flat = ok.tolist()
    out, off = [], 0
    for d in drafts:
        out.append(flat[off : off + len(d)])
        off += len(d)
    return out


def _uniforms(n: int, drafts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
              generators: Sequence[torch.Generator | None], dev: torch.device) -> torch.Tensor:
    """[n] U(0, 1), one per proposal, each from its request's generator; requests sharing a
    generator draw theirs in one call (in request order)."""
    u = torch.zeros(n, device=dev)
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    off = 0
    for i, d in enumerate(drafts):
        if len(d) and not params[i].greedy:
            groups.setdefault(id(generators[i]), (generators[i], []))[1].extend(
                range(off, off + len(d)))
        off += len(d)
    for g, idx in groups.values():
        u[_on_device(idx, dev)] = torch.empty(len(idx), device=dev).uniform_(generator=g)
    return u


def _residuals(dist: torch.Tensor, sampled: list[int], drafts: Sequence[Sequence[int]],
               draft_probs: Sequence[torch.Tensor | None], accepted: list[int],
               dev: torch.device) -> None:
    """In place on dist [S, V] (q at each sampled request's last row): rows whose request
    rejected a proposal become max(q - p, 0); the race normalizes them."""
    point, point_tok, model, model_p = [], [], [], []
    for s, i in enumerate(sampled):
        m = accepted[i]
        if m == len(drafts[i]):
            continue
        if draft_probs[i] is None:
            point.append(s)
            point_tok.append(drafts[i][m])
        else:
            model.append(s)
            model_p.append(draft_probs[i][m])
    if not point and not model:
        return
    at = _on_device(point + model, dev)
    q_rows = dist[at]  # a copy: the fallback below
    if point:
        dist[_on_device(point, dev), _on_device(point_tok, dev)] = 0.0
    if model:
        rows = _on_device(model, dev)
        dist[rows] = (dist[rows] - torch.stack(model_p)).clamp_(min=0.0)
    # q == p (up to rounding) rejects with probability ~0; should it happen the residual is empty
    # and q itself is the only sensible choice (the race would return token 0).
    res = dist[at]
    dist[at] = torch.where((res.sum(dim=1) > 0)[:, None], res, q_rows)
