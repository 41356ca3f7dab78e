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
from itertools import accumulate

import torch

from milepost.engine.sampling import _on_device, _race, _truncate
from milepost.engine.sampling_params import SamplingParams

# The accepted prefixes and kept tokens by kernels/spec_accept.py (None: on CUDA; a test sets
# True to run them under Triton's interpreter on CPU).
DEVICE_KERNELS: bool | None = None


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
    point mass (n-gram). Batched over requests; the results are read back together (one wait)."""
    return launch_verify(logits, drafts, draft_probs, params, generators).result()


@dataclass
class PendingVerdict:
    """A verification launched on the device (its results copied to pinned memory behind an
    event on CUDA): `result()` waits for them and builds the Verdict."""

    ints: torch.Tensor  # [n, 1 + kmax + 1]: accepted count, then the kept tokens
    logprobs: torch.Tensor  # [n, kmax + 1]
    copied: torch.cuda.Event | None
    starts: list[int]
    logprobs_all: torch.Tensor

    def result(self) -> Verdict:
        if self.copied is not None:
            self.copied.synchronize()
        accepted, tokens, logprobs, out_rows = [], [], [], []
        for start, row, lp in zip(self.starts, self.ints.tolist(), self.logprobs.tolist()):
            m_i = row[0]
            accepted.append(m_i)
            tokens.append(row[1 : m_i + 2])
            logprobs.append(lp[: m_i + 1])
            out_rows.append(list(range(start, start + m_i + 1)))
        return Verdict(tokens, logprobs, out_rows, accepted, self.logprobs_all)


def launch_verify(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> PendingVerdict:
    """`verify`'s device work, queued without waiting: the engine queues it before it reads back
    the step's other rows, so the verifier's host work overlaps the forward instead of following
    it. (Draft-model proposals read draft_probs on the device, as queued.)"""
    logits = logits.float()
    dev = logits.device
    counts = [len(d) + 1 for d in drafts]
    starts = list(accumulate(counts[:-1], initial=0))
    row_params = [p for p, n in zip(params, counts) for _ in range(n)]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    kmax = max(counts) - 1
    # q: [rows of sampled requests, V] the target's sampling distribution; q_at[r]: row r's
    # index in q (0 for greedy rows, whose q is never read: they compare with the argmax).
    q_rows = [starts[i] + j for i in sampled for j in range(counts[i])]
    q_at = [0] * len(row_params)
    for n, r in enumerate(q_rows):
        q_at[r] = n
    kernels = DEVICE_KERNELS if DEVICE_KERNELS is not None else dev.type == "cuda"
    on = _stage(dev, _index_lists(drafts, draft_probs, params, generators, starts, sampled, q_at,
                                  cells=not kernels))

    scaled = logits
    temps = [1.0 if p.greedy else p.temperature for p in row_params]
    if any(t != 1.0 for t in temps):
        scaled = logits / _on_device(temps, dev)[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)  # [R, V]
    argmax = logits.argmax(dim=-1)  # [R]
    q = None
    if sampled:
        q = logprobs_all[q_rows].exp() if len(sampled) < len(params) else logprobs_all.exp()
        _truncate(q, [row_params[r] for r in q_rows])
        q /= q.sum(dim=1, keepdim=True)

    # Every proposal's test at once; each request's accepted prefix, its final token and the
    # log-probs of what it keeps are found on the device and read back together (one wait).
    if kernels:
        from milepost.kernels import spec_accept  # (Triton: imported where it runs)
    n = len(drafts)
    ok = None
    if sampled or not kernels:  # (greedy only: the kernel compares proposals with the argmax)
        ok = _accept_flags(q, on, argmax, drafts, draft_probs, params, generators, dev)
    if kernels:
        accepted_t, last = spec_accept.accepted(ok, on["toks"], argmax, on["offs"], on["lens"],
                                                on["starts"], kmax)
    else:
        accepted_t, last = _accepted(ok, on, n, kmax, dev)

    # One token drawn at row starts[i] + m: greedy argmax, else q there, or after a rejection
    # the residual max(q - p, 0) (a point mass p: q without the rejected token).
    final = None
    if sampled or not kernels:
        final = argmax[last]
    if sampled:
        sampled_t = on["sampled"]
        q_last = q[on["q_at"][last[sampled_t]]]  # [S, V]
        dist = _residuals(q_last, sampled, drafts, draft_probs, accepted_t[sampled_t],
                          on["lens"][sampled_t], on["offs"][sampled_t], on)
        final[sampled_t] = _race(dist, [generators[i] for i in sampled])

    if kernels:
        ints, kept_lp = spec_accept.kept(accepted_t, final, on["toks"], argmax, on["offs"],
                                         on["starts"], logprobs_all, kmax)
    else:
        ints, kept_lp = _kept(accepted_t, final, on, logprobs_all, n, kmax, dev)
    copied = None
    if dev.type == "cuda":  # both copied behind one event: `result` waits once
        ints, kept_lp = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in (ints, kept_lp))
        copied = torch.cuda.Event()
        copied.record()
    return PendingVerdict(ints, kept_lp, copied, starts, logprobs_all)


def _accepted(ok: torch.Tensor | None, on: dict[str, torch.Tensor], n: int, kmax: int,
              dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(m [n]: the proposals before each request's first rejection, last row [n]) in torch ops
    (kernels/spec_accept.py's `accepted` on CUDA)."""
    if ok is None:
        accepted_t = torch.zeros(n, dtype=torch.long, device=dev)
    else:
        cell = on["cell"].view(-1, 2)
        passed = torch.zeros((n, kmax), dtype=torch.int32, device=dev)
        passed[cell[:, 0], cell[:, 1]] = ok.to(torch.int32)
        accepted_t = passed.cumprod(dim=1).sum(dim=1)
    return accepted_t, on["starts"] + accepted_t


def _kept(accepted_t: torch.Tensor, final: torch.Tensor, on: dict[str, torch.Tensor],
          logprobs_all: torch.Tensor, n: int, kmax: int, dev: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Request i keeps proposals 0 .. m - 1 and the final token: positions j <= m of its rows.
    (ints [n, kmax + 2]: m, then the kept tokens; their log-probs [n, kmax + 1]) in torch ops
    (kernels/spec_accept.py's `kept` on CUDA)."""
    drafts_pad = torch.zeros((n, max(kmax, 1)), dtype=torch.long, device=dev)
    if on["toks"].numel():
        cell = on["cell"].view(-1, 2)
        drafts_pad[cell[:, 0], cell[:, 1]] = on["toks"]
    j = torch.arange(kmax + 1, device=dev)[None, :]
    m = accepted_t[:, None]
    proposed = torch.nn.functional.pad(drafts_pad, (0, 1))[:, : kmax + 1]
    kept_tok = torch.where(j < m, proposed, final[:, None])
    kept_row = on["starts"][:, None] + torch.minimum(j, m)
    return torch.cat([m, kept_tok], dim=1), logprobs_all[kept_row, kept_tok]


def _index_lists(drafts: Sequence[Sequence[int]], draft_probs: Sequence[torch.Tensor | None],
                 params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 starts: list[int], sampled: list[int], q_at: list[int], cells: bool = True
                 ) -> dict[str, list[int]]:
    """Every small index list the verifier's device work reads, built on the host (cells: each
    proposal's (request, index), which only the torch path reads)."""
    lists = {
        "toks": [t for d in drafts for t in d],  # every proposal
        "lens": [len(d) for d in drafts],
        "offs": list(accumulate((len(d) for d in drafts[:-1]), initial=0)),  # first proposal's
        "starts": starts,
        "rows": [starts[i] + j for i, d in enumerate(drafts) for j in range(len(d))],  # proposals'
    }
    if cells:
        lists["cell"] = [x for i, d in enumerate(drafts) for j in range(len(d)) for x in (i, j)]
    if not sampled:
        return lists
    lists["sampled"] = sampled
    lists["q_at"] = q_at
    lists["greedy"] = [int(params[i].greedy) for i, d in enumerate(drafts) for _ in d]
    with_p = [i for i, (d, p) in enumerate(zip(drafts, draft_probs)) if p is not None and len(d)]
    lists["with_p"] = [starts[i] - i + j for i in with_p for j in range(len(drafts[i]))]
    groups: dict[int, list[int]] = {}  # uniforms: the proposals of each generator, in order
    off = 0
    for i, d in enumerate(drafts):
        if len(d) and not params[i].greedy:
            groups.setdefault(id(generators[i]), []).extend(range(off, off + len(d)))
        off += len(d)
    lists["uniform"] = [x for idx in groups.values() for x in idx]
    lists["point"] = [s for s, i in enumerate(sampled) if draft_probs[i] is None and len(drafts[i])]
    model = [s for s, i in enumerate(sampled) if draft_probs[i] is not None and len(drafts[i])]
    lists["model"] = model
    first = [0]
    for s in model[:-1]:
        first.append(first[-1] + len(drafts[sampled[s]]))
    lists["model_first"] = first if model else []
    return lists


def _stage(dev: torch.device, lists: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The lists on the device in one copy, as views of it by name. Sent one by one they cost a
    pinned copy each: `_on_device` was 9% of a speculative step's host time on an H100 (session
    32, py-spy), with 5 to 12 such lists a step."""
    flat = [x for v in lists.values() for x in v]
    t = _on_device(flat, dev) if flat else torch.empty(0, dtype=torch.long, device=dev)
    out, off = {}, 0
    for name, v in lists.items():
        out[name] = t[off : off + len(v)]
        off += len(v)
    return out


def _accept_flags(q: torch.Tensor | None, on: dict[str, torch.Tensor], argmax: torch.Tensor,
                  drafts: Sequence[Sequence[int]], draft_probs: Sequence[torch.Tensor | None],
                  params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  dev: torch.device) -> torch.Tensor | None:
    """[proposals] bool, request by request: whether each proposal (on["toks"], flattened) passes
    its own test (only a prefix of a request's counts); None when nothing was proposed."""
    rows_t, toks = on["rows"], on["toks"]
    if not rows_t.numel():
        return None
    ok = argmax[rows_t] == toks
    if q is not None:
        target = q[on["q_at"][rows_t], toks]  # q(d) (read on greedy rows too, then not used)
        proposal = torch.ones_like(target)  # p(d): 1 for a point mass
        with_p = [i for i, (d, p) in enumerate(zip(drafts, draft_probs)) if p is not None and len(d)]
        if with_p:
            at = on["with_p"]
            p_all = torch.cat([draft_probs[i][: len(drafts[i])] for i in with_p])  # [n, V]
            proposal[at] = p_all.gather(1, toks[at][:, None]).squeeze(1)
        u = _uniforms(rows_t.numel(), on["uniform"], drafts, params, generators, dev)
        # u < q/p, written u * p < q: no division by a p that underflowed to 0.
        ok = torch.where(on["greedy"].bool(), ok, u * proposal < target)
    return ok


def _uniforms(n: int, order: torch.Tensor, drafts: Sequence[Sequence[int]],
              params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
              dev: torch.device) -> torch.Tensor:
    """[n] U(0, 1), one per proposal, each from its request's generator; requests sharing a
    generator draw theirs in one call (in request order). order: the proposals of each
    generator in turn (_index_lists), where the draws go."""
    sizes: dict[int, tuple[torch.Generator | None, int]] = {}
    for i, d in enumerate(drafts):
        if len(d) and not params[i].greedy:
            g, k = sizes.get(id(generators[i]), (generators[i], 0))
            sizes[id(generators[i])] = (g, k + len(d))
    u = torch.zeros(n, device=dev)
    if sizes:
        draws = [torch.empty(k, device=dev).uniform_(generator=g) for g, k in sizes.values()]
        u[order] = torch.cat(draws) if len(draws) > 1 else draws[0]
    return u


def _residuals(q_last: torch.Tensor, sampled: list[int], drafts: Sequence[Sequence[int]],
               draft_probs: Sequence[torch.Tensor | None], accepted: torch.Tensor,
               lens: torch.Tensor, offs: torch.Tensor, on: dict[str, torch.Tensor]) -> torch.Tensor:
    """What to draw each sampled request's final token from: q at its last row (q_last [S, V]),
    or, where the request rejected a proposal (accepted [S] < lens [S], on the device),
    max(q - p, 0) with p the point mass of the rejected proposal (on["toks"] from offs [S], each
    request's first) or its draft model's distribution; the race normalizes them. on:
    _index_lists' "point" (sampled requests with n-gram proposals), "model" (with a draft
    model's) and "model_first"."""
    rejected = accepted < lens
    dist = q_last.clone()
    at = torch.minimum(accepted, (lens - 1).clamp(min=0))[:, None]  # the rejected proposal (if any)
    if on["point"].numel():
        rows = on["point"]
        cols = on["toks"][offs[rows] + at[rows, 0]]
        dist[rows, cols] = torch.where(rejected[rows], 0.0, dist[rows, cols])
    if on["model"].numel():
        rows = on["model"]
        model = [s for s, i in enumerate(sampled) if draft_probs[i] is not None and len(drafts[i])]
        p_all = torch.cat([draft_probs[sampled[s]][: len(drafts[sampled[s]])] for s in model])
        p = p_all[on["model_first"] + at[rows, 0]]  # the rejected proposal's distribution
        dist[rows] = torch.where(rejected[rows, None], (dist[rows] - p).clamp_(min=0.0), dist[rows])
    # q == p (up to rounding) rejects with probability ~0; should it happen the residual is empty
    # and q itself is the only sensible choice (the race would return token 0).
    empty = rejected & (dist.sum(dim=1) <= 0)
    return torch.where(empty[:, None], q_last, dist)
