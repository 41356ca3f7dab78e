"""One read of the logits for the common sampling case: temperature only, no truncation.

The torch sampler (milepost/engine/sampling.py) runs log_softmax, exp, an Exp(1) fill of a
[B, V] tensor, a division and an argmax: five full passes over fp32 [B, V] (0.74 ms of GPU time
a step for 256 rows of Qwen3's 151,936 logits on an H200). Two methods here, both giving the
reported log-prob `logits[tok] / T - lse`, the distribution the trainer recomputes, and taking
the first maximum for greedy rows (temperature < GREEDY_EPS; log-prob at T = 1, as the torch
sampler does):

- "cdf" (default, fused_sampler_cdf.py): inverse-CDF sampling with two uniforms a row. Pass 1
  reads each 2048-token chunk once (max, sum of exp); a second kernel per row picks a chunk by the
  chunks' masses and then a token of that chunk by its cumulative sum (fp64 sums, 53-bit
  uniforms), reading only that chunk again. One exp a token, no random number a token.
- "race": the exponential race `argmax(p / q)`, q = -log u, u ~ U(0, 1) from Philox keyed by the
  row's seed and the token index (Gumbel-max, the race torch's sampler runs too). It needs a
  Philox draw and a log per token (183-187 us for 256 x 151,936 fp32 logits on an H200), and
  since u is an fp32 number (steps of 2^-24 below 1), q is never below ~6e-8: a token whose
  probability is far below that (the long tail of a 151,936-token softmax) is almost never drawn.
  The cdf method has no such floor (see fused_sampler_cdf.py); the race stays for A/B runs.

The draws depend on the row's seed and logits only, not on the batch or the device's
scheduling; `splits` and `num_warps` change the work layout only (the same tokens up to the
rounding of near-tied sums or keys). Seeds come from each request's generator (one device-side
draw per step), so a seeded request is reproducible run to run; its tokens differ from the torch
sampler's, and between the two methods (same distribution: tests/gpu/test_fused_sampler_cuda.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from milepost.kernels.fused_sampler_cdf import CHUNK, cdf_sample

BLOCK = 2048
SPLITS = 32  # race: parts per row; with 4 warps the fastest measured layout (H200, 64 and 256 rows)
METHODS = ("cdf", "race")
METHOD = "cdf"  # the default; benchmarks/sampler_gpu.py times both


@triton.jit
def _scan(base, inv_t, greedy, col0, hi, r, m, s, best, best_i, Q: tl.constexpr):
    """Fold tokens col0 .. col0 + Q (their uniforms r) into (max, sum-exp, best key, its index).

    The race's key of a sampled token is log(p / q) up to the row's constant: p / q =
    exp(z - m) / -log(u), so one exp serves the sum and the race and a block pays one log per
    token (for q) and one for its best ratio. A token whose exp(z - m) underflows (more than 87
    below the block's max) cannot win: its chance is below 1e-38."""
    cols = col0 + tl.arange(0, Q)
    mask = cols < hi
    x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
    z = x * inv_t  # exact for T = 1; else within an ulp of logits / T (the log-prob is exact)
    m_new = tl.maximum(m, tl.max(z, 0))
    e = tl.where(mask, tl.exp(z - m_new), 0.0)
    # exp(-inf - -inf) is NaN: a part whose values are all -inf so far keeps s = 0
    s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.sum(e, 0))
    if greedy:
        k_max, k_arg = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    else:
        ratio = tl.where(mask, e / -tl.log(r), 0.0)  # r = 0: q = inf, ratio 0
        r_max, k_arg = tl.max(ratio, 0, return_indices=True, return_indices_tie_break_left=True)
        k_max = tl.where(r_max > 0, tl.log(r_max) + m_new, float("-inf"))
    take = k_max > best  # strictly: the first maximum wins, as argmax
    return m_new, s, tl.where(take, k_max, best), tl.where(take, k_arg + col0, best_i)


@triton.jit
def _partial(Z, SEED, TEMP, GREEDY, M, S, KEY, IDX, n_vocab, stride_z, per_split,
             SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    base = Z + row * stride_z
    inv_t = 1.0 / tl.load(TEMP + row)
    greedy = tl.load(GREEDY + row) != 0
    seed = tl.load(SEED + row)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.zeros((), dtype=tl.int32)
    lo = part * per_split
    hi = tl.minimum(lo + per_split, n_vocab)
    Q: tl.constexpr = BLOCK // 4
    for start in range(lo, hi, BLOCK):
        # one Philox call gives four uniforms: token start + j * Q + i takes the j-th of call
        # (start // 4 + i). BLOCK is fixed and every part starts at a multiple of it, so a
        # token's uniform depends on its index and the row's seed only
        r0, r1, r2, r3 = tl.rand4x(seed, start // 4 + tl.arange(0, Q))
        m, s, best, best_i = _scan(base, inv_t, greedy, start, hi, r0, m, s, best, best_i, Q)
        m, s, best, best_i = _scan(base, inv_t, greedy, start + Q, hi, r1, m, s, best, best_i, Q)
        m, s, best, best_i = _scan(base, inv_t, greedy, start + 2 * Q, hi, r2, m, s, best, best_i, Q)
        m, s, best, best_i = _scan(base, inv_t, greedy, start + 3 * Q, hi, r3, m, s, best, best_i, Q)
    out = row * SPLITS + part
    tl.store(M + out, m)
    tl.store(S + out, s)
    tl.store(KEY + out, best)
    tl.store(IDX + out, tl.where(best == float("-inf"), -1, best_i))


@triton.jit
def _merge(Z, TEMP, M, S, KEY, IDX, TOK, LOGP, stride_z, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    parts = row * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(M + parts)
    s = tl.load(S + parts)
    key = tl.load(KEY + parts)
    idx = tl.load(IDX + parts)
    m_all = tl.max(m, 0)
    total = tl.sum(tl.where(s > 0, s * tl.exp(m - m_all), 0.0), 0)
    best = tl.max(key, 0)
    # the first part holding the maximum (parts are in token order): the first maximum overall
    first = tl.min(tl.where(key == best, tl.arange(0, SPLITS), SPLITS), 0)
    tok = tl.sum(tl.where(tl.arange(0, SPLITS) == first, idx, 0), 0)
    tok = tl.maximum(tok, 0)  # an all -inf row (cannot happen after the engine's checks)
    x = tl.load(Z + row * stride_z + tok).to(tl.float32)
    tl.store(TOK + row, tok.to(tl.int64))
    tl.store(LOGP + row, tl.math.div_rn(x, tl.load(TEMP + row)) - (m_all + tl.log(total)))


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
                 seeds: torch.Tensor, splits: int = SPLITS, num_warps: int = 4,
                 method: str | None = None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (fp32 or bf16, CUDA), temperatures [B] fp32 (greedy rows: 1.0), greedy [B]
    int8, seeds [B] int64 -> (tokens [B] int64, log-probs [B] fp32 of logits / T at the token).

    method: "cdf" | "race" (None: METHOD). splits (programs per row; race: a power of two) and
    num_warps change the work layout only: the same tokens (cdf: whatever the splits; otherwise
    up to the rounding of near-tied sums or keys), log-probs to the last bits (the summation
    order). chunk (cdf only, a power of two) is the unit of the first pick: another chunk draws
    other tokens from the same distribution."""
    method = METHOD if method is None else method
    if method not in METHODS:
        raise ValueError(f"fused_sample: method={method!r} is not one of {METHODS}")
    if logits.stride(-1) != 1:
        raise ValueError("fused_sample: logits must have contiguous rows (stride 1 along the "
                         "vocabulary); pass logits.contiguous()")
    if method == "cdf":
        return cdf_sample(logits, temperatures, greedy, seeds, splits, num_warps, chunk)
    return _race_sample(logits, temperatures, greedy, seeds, splits, num_warps)


def _race_sample(logits: torch.Tensor, temperatures: torch.Tensor, greedy: torch.Tensor,
                 seeds: torch.Tensor, splits: int, num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, v = logits.shape
    dev = logits.device
    per_split = triton.cdiv(triton.cdiv(v, splits), BLOCK) * BLOCK
    m = torch.empty((b, splits), dtype=torch.float32, device=dev)
    s, key = torch.empty_like(m), torch.empty_like(m)
    idx = torch.empty((b, splits), dtype=torch.int32, device=dev)
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    logp = torch.empty(b, dtype=torch.float32, device=dev)
    if b == 0:
        return tokens, logp
    _partial[(b, splits)](logits, seeds, temperatures, greedy, m, s, key, idx, v, logits.stride(0),
                          per_split, SPLITS=splits, BLOCK=BLOCK, num_warps=num_warps)
    _merge[(b,)](logits, temperatures, m, s, key, idx, tokens, logp, logits.stride(0),
                 SPLITS=splits, num_warps=1)
    return tokens, logp
