"""The batched sampler (the parameters, SGLang's names, live in sampling_params.py).

Rollout log-probs are `log_softmax(logits / temperature)` at the sampled token, in fp32, taken
BEFORE top-p / top-k / min-p truncation: that is the distribution the trainer recomputes, so the
train-rollout mismatch stays measurable. Greedy requests (temperature < 1e-5) report
`log_softmax(logits)` (temperature 1) since dividing by ~0 would make every log-prob 0 or -inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from milepost.engine.grammar import apply_masks
from milepost.engine.penalties import adjust_logits
from milepost.engine.sampling_params import GREEDY_EPS, SamplingParams

__all__ = ["GREEDY_EPS", "SampleResult", "SamplingParams", "sample"]


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32, log_softmax(logits / T) at the token
    top_ids: torch.Tensor | None  # [B, k] int64
    top_logprobs: torch.Tensor | None  # [B, k] fp32
    ids_logprobs: torch.Tensor | None = None  # [B, K] fp32: token_ids[i] of row i, padded


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    banned: list[list[int]],
    top_logprobs_num: int = 0,
    outputs: list[list[int]] | None = None,
    token_ids: list[list[int] | None] | None = None,
    masks: tuple[list[int], torch.Tensor] | None = None,
    fused: bool = False,
) -> SampleResult:
    """logits: [B, V] fp32 -> one token per row, the whole batch in a few batched ops.

    banned[i]: token ids row i may not produce this step (stop tokens before min_new_tokens).
    token_ids[i]: ids whose log-probs row i reports (None: none).
    outputs[i]: row i's output ids so far, needed when a row has penalties or a logit bias
    (penalties.py); those adjust the logits first, so the reported log-probs are those of the
    distribution actually sampled (as in SGLang).
    masks: (rows, bitmask [len(rows), ceil(V/32)] int32 on the host) of the rows under a grammar
    (grammar.py); tokens they do not allow get -inf, after penalties and bans, before
    temperature: reported log-probs are those of the masked distribution, the one sampled.
    One log_softmax serves both the reported log-probs and the sampling probabilities (no second
    pass over the logits). Greedy rows take the argmax; sampled rows draw by the exponential race
    argmax(p / q), q ~ Exp(1), which is what torch.multinomial does for one sample, so a seeded
    request draws exactly the tokens the former row-by-row sampler drew. Rows that share a
    generator (unseeded requests) draw their q in one call: the same numbers as row by row on
    CPU; on CUDA the generator's offsets advance per call, so those draws differ from the former
    ones (same distribution, still determined by --random-seed). Unlike torch.multinomial there
    is no validity check that syncs with the host per row. Truncations run only on the rows that
    ask for them, with per-row settings in tensors (top-k and top-p via torch.topk, no full sort).

    fused (CUDA): a batch that asks for nothing but temperatures (no truncation, penalties, bans,
    grammar, top/extra log-probs) is sampled in one pass by milepost/kernels/fused_sampler.py
    (Gumbel-max race keyed by a per-row seed from the row's generator; same distribution, other
    draws than the race below).
    """
    if fused and logits.is_cuda and top_logprobs_num == 0 and token_ids is None and masks is None \
            and not any(banned) \
            and all(_temperature_only(p, logits.shape[-1]) for p in params):
        return _fused(logits, params, generators)
    logits = logits.float()
    adjust = outputs is not None and any(p.adjusts_logits for p in params)
    if adjust or masks is not None or any(banned):
        # .float() is a no-op on fp32 input: copy so the caller's logits stay intact.
        logits = logits.clone()
    if adjust:
        adjust_logits(logits, params, outputs)
    if any(banned):
        rows = [i for i, ids in enumerate(banned) for _ in ids]
        cols = [t for ids in banned for t in ids]
        logits[rows, cols] = float("-inf")
    if masks is not None:
        apply_masks(logits, *masks)
    temps = [1.0 if p.greedy else p.temperature for p in params]
    scaled = logits
    if any(t != 1.0 for t in temps):  # x / 1.0 == x exactly: skip the pass when all are 1
        scaled = logits / _on_device(temps, logits.device)[:, None]
    logprobs_all = torch.log_softmax(scaled, dim=-1)  # [B, V]

    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        probs = logprobs_all.exp() if not greedy else logprobs_all[drawn].exp()  # [n, V]
        _truncate(probs, [params[i] for i in drawn])
        picked = _race(probs, [generators[i] for i in drawn])
        if greedy:
            tokens[drawn] = picked
        else:
            tokens = picked

    chosen = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    top_ids = top_lp = None
    if top_logprobs_num > 0:
        top_lp, top_ids = logprobs_all.topk(min(top_logprobs_num, logits.shape[-1]), dim=-1)
    ids_lp = None
    if token_ids is not None:  # SGLang's token_ids_logprob: these ids' log-probs at each step
        width = max(len(t or []) for t in token_ids)
        cols = _on_device([(t or []) + [0] * (width - len(t or [])) for t in token_ids],
                          logits.device)
        ids_lp = logprobs_all.gather(1, cols)
    return SampleResult(tokens, chosen, top_ids, top_lp, ids_lp)


def _temperature_only(p: SamplingParams, vocab: int) -> bool:
    return (p.top_k <= 0 or p.top_k >= vocab) and p.min_p <= 0.0 and p.top_p >= 1.0 \
        and not p.adjusts_logits


def _fused(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> SampleResult:
    """Per-row settings as the kernel's tensors, then one call. The host loops stay few and
    read plain fields: at 256 rows they are a visible part of the call next to the kernel."""
    from milepost.kernels.fused_sampler import fused_sample  # triton: CUDA only

    dev = logits.device
    n = len(params)
    first = generators[0]
    if all(g is first for g in generators):  # unseeded rows share one generator: one draw
        seeds = torch.randint(0, 2**62, (n,), generator=first, device=dev)
    else:
        seeds = _row_seeds(generators, dev)
    temps = [p.temperature for p in params]
    greedy = [t < GREEDY_EPS for t in temps]  # SamplingParams.greedy, without a property call a row
    if all(t == temps[0] for t in temps):  # the usual batch: fills, no copies
        t = torch.full((n,), 1.0 if greedy[0] else float(temps[0]), dtype=torch.float32, device=dev)
        g = torch.full((n,), int(greedy[0]), dtype=torch.int8, device=dev)
    else:
        t = _on_device([1.0 if gr else float(x) for x, gr in zip(temps, greedy)], dev).float()
        g = _on_device([int(gr) for gr in greedy], dev).to(torch.int8)
    tokens, logprobs = fused_sample(logits, t, g, seeds)
    return SampleResult(tokens, logprobs, None, None)


def _row_seeds(generators: list[torch.Generator | None], dev: torch.device) -> torch.Tensor:
    """One kernel seed a row from its own generator (one device-side draw per generator: no host
    sync), so a seeded request's draws do not depend on the rest of the batch."""
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for j, g in enumerate(generators):
        groups.setdefault(id(g), (g, []))[1].append(j)
    draws = [torch.randint(0, 2**62, (len(rows),), generator=g, device=dev)
             for g, rows in groups.values()]
    order = [j for _, rows in groups.values() for j in rows]
    seeds = torch.empty(len(generators), dtype=torch.int64, device=dev)
    seeds[_on_device(order, dev)] = torch.cat(draws)  # back to row order
    return seeds


# Nucleus candidates looked at first; a row whose nucleus is wider falls back to a full sort.
TOP_P_CANDIDATES = 1024


def _truncate(probs: torch.Tensor, params: list[SamplingParams]) -> None:
    """Zero, in place, what each row's top-k, then min-p, then top-p drop; probs: [n, V]."""
    vocab = probs.shape[1]
    dev = probs.device
    rows = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
    if rows:
        ks = [params[j].top_k for j in rows]  # the widest k from the host: no device sync
        sub = probs[rows]
        kth = sub.topk(max(ks)).values.gather(1, _on_device(ks, dev)[:, None] - 1)  # [r, 1]
        probs[rows] = sub.masked_fill_(sub < kth, 0.0)
    rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if rows:
        min_p = _on_device([params[j].min_p for j in rows], dev)
        sub = probs[rows]
        floor = min_p[:, None] * sub.amax(dim=1, keepdim=True)
        probs[rows] = sub.masked_fill_(sub < floor, 0.0)
    rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        top_p = _on_device([params[j].top_p for j in rows], dev)
        probs[rows] = _nucleus(probs[rows], top_p)


def _on_device(values: list, device: torch.device) -> torch.Tensor:
    """A small per-row settings tensor on `device`. On CUDA it goes through pinned memory: a
    copy from pageable memory waits for all queued GPU work (e.g. the next step's forward under
    the overlap schedule); this one is queued like a kernel."""
    t = torch.tensor(values)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor, on_device: bool | None = None) -> torch.Tensor:
    """Keep, per row, the most likely tokens until the mass BEFORE a token reaches top_p * total.

    The most likely token is always kept: a top_p that underflows (1e-300 is 0 in fp32) must not
    empty the row, which would make the race return token 0.

    probs: [r, V] (unnormalized after other truncations), top_p: [r]. Sorting only the top
    TOP_P_CANDIDATES is exact whenever the nucleus ends inside them (the cumulative sums over
    the head of a full sort are the same numbers). The other rows ("wide") get their nucleus on
    CUDA (on_device, default: probs there) from kernels/top_p_wide.py, with no read-back, so a
    top-p batch keeps the overlap schedule; elsewhere the host picks them and sorts them whole.
    """
    limit = top_p * probs.sum(dim=1)  # [r]
    k = min(TOP_P_CANDIDATES, probs.shape[1])
    vals, ids = probs.topk(k, dim=1)  # sorted descending
    before = vals.cumsum(dim=1) - vals
    drop = before >= limit[:, None]
    drop[:, 0] = False
    out = torch.zeros_like(probs).scatter_(1, ids, vals.masked_fill_(drop, 0.0))
    if on_device is None:
        on_device = probs.is_cuda
    if k < probs.shape[1] and on_device and probs.dtype == torch.float32:
        from milepost.kernels.top_p_wide import nucleus_wide_

        nucleus_wide_(probs.contiguous(), out, limit, before[:, -1] + vals[:, -1] < limit)
    elif k < probs.shape[1]:
        wide = (before[:, -1] + vals[:, -1] < limit).nonzero().flatten().tolist()
        if wide:  # the nucleus spills past the candidates: sort those rows whole
            vals, ids = probs[wide].sort(dim=1, descending=True)
            before = vals.cumsum(dim=1) - vals
            drop = before >= limit[wide, None]
            drop[:, 0] = False
            out[wide] = torch.zeros_like(vals).scatter_(1, ids, vals.masked_fill_(drop, 0.0))
    return out


def _race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """argmax(probs / q) per row with q ~ Exp(1) from the row's generator; probs: [n, V] (consumed).

    Rows sharing a generator fill their q in one call, in row order, as the former per-row
    multinomial consumed that generator's stream.
    """
    groups: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for j, g in enumerate(generators):
        groups.setdefault(id(g), (g, []))[1].append(j)
    q = torch.empty_like(probs)
    for g, rows in groups.values():
        if len(rows) == probs.shape[0]:
            q.exponential_(generator=g)
        elif len(rows) == 1:
            q[rows[0]].exponential_(generator=g)
        else:
            q[rows] = torch.empty_like(probs[: len(rows)]).exponential_(generator=g)
    return probs.div_(q).argmax(dim=1)
