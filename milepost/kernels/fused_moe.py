"""Fused MoE experts in Triton: routing aligned on the device, gate/up with SiLU·up fused, down with
the routing weight applied, a fixed-order combine over the k slots.

Four launches per MoE layer, no host sync, buffers sized by the worst case for T tokens (so a CUDA
graph can capture them): (1) `_align_kernel`, one program per expert, lays the (token, slot) pairs
of each expert out in pair order, padded to BLOCK_M rows (pad rows hold the sentinel T*k);
(2) `_gate_up_kernel` computes the gate and up tiles of the same columns and stores silu(gate)*up,
so the [T*k, 2I] intermediate never exists; (3) `_down_kernel` writes each pair's row already times
its routing weight; (4) `_combine_kernel` sums each token's k rows in slot order. Every output
element comes from one program with a fixed reduction order (no atomics, no split-K): the result is
bitwise reproducible. An expert whose rows fit one M block has its weights read once per step.
Rounding follows grouped_experts.py (gate/up and down outputs rounded to the model dtype, the
weighted product rounded, the k-sum in fp32 rounded once); only the GEMMs' summation order differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    """Tile of one of the two expert GEMMs (BLOCK_M is shared: see MoeConfig)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # M blocks that walk the N tiles together (weight tiles reused from L2)
    swap_ab: bool = False  # weight rows on the MMA's M side, tokens on N (few rows per expert)


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    hist_align: bool = False  # count pairs per expert with tl.histogram (else compare with every id)

    def label(self) -> str:
        g, d = self.gate_up, self.down
        return (f"m{self.block_m} gu:n{g.block_n}k{g.block_k}w{g.num_warps}s{g.num_stages}g{g.group_m}"
                f"{'T' if g.swap_ab else ''} dn:n{d.block_n}k{d.block_k}w{d.num_warps}s{d.num_stages}"
                f"g{d.group_m}{'T' if d.swap_ab else ''}"
                f"{' hist' if self.hist_align else ''}")


def _cfg(block_m: int, gu: tuple, dn: tuple, hist: bool = True) -> MoeConfig:
    """gu / dn: (block_n, block_k, num_warps, num_stages, swap_ab)."""
    return MoeConfig(block_m, GemmConfig(gu[0], gu[1], gu[2], gu[3], 8, gu[4]),
                     GemmConfig(dn[0], dn[1], dn[2], dn[3], 8, dn[4]), hist)


# Where the fused path was measured faster than grouped_experts.py, per expert shape
# (experts, hidden, moe_intermediate, top_k): (largest token count, config or None = grouped faster),
# ascending; token counts past the last bucket, and shapes not listed, keep the grouped GEMMs.
# From benchmarks/moe_sweep.py on one H200 (2026-12-04, torch 2.11, triton 3.6; benchmarks/RESULTS.md):
# the best config per token count, fused faster than grouped at every one (x1.38 to x3.29).
MEASURED: dict[tuple[int, int, int, int], tuple[tuple[int, MoeConfig | None], ...]] = {
    (128, 2048, 768, 8): (  # Qwen3-30B-A3B
        (1, _cfg(16, (32, 128, 4, 4, False), (128, 128, 4, 3, True), hist=False)),  # 29.6 vs 97.2 us
        (16, _cfg(16, (64, 128, 4, 3, True), (64, 128, 4, 3, True))),  # 193.7 vs 347.3 us
        (64, _cfg(16, (64, 128, 4, 3, True), (64, 128, 4, 3, True))),  # 281.9 vs 476.7 us
        (128, _cfg(16, (64, 128, 4, 3, True), (64, 128, 4, 4, False))),  # 291.5 vs 491.2 us
        (256, _cfg(32, (64, 128, 4, 3, False), (64, 128, 4, 3, True))),  # 300.7 vs 501.5 us
        (1024, _cfg(64, (64, 64, 4, 4, False), (128, 64, 4, 3, False))),  # 384.3 vs 613.6 us
        (2048, _cfg(128, (128, 64, 8, 4, False), (256, 64, 8, 3, False))),  # 510.4 vs 854.8 us
        (4096, _cfg(128, (128, 64, 8, 4, False), (256, 64, 8, 3, False))),  # 827.7 vs 1146.1 us
    ),
}


def config_for(tokens: int, num_experts: int, hidden: int, inter: int, top_k: int) -> MoeConfig | None:
    """The measured config for `tokens` (smallest bucket that holds it), or None: use grouped GEMMs."""
    for max_tokens, cfg in MEASURED.get((num_experts, hidden, inter, top_k), ()):
        if tokens <= max_tokens:
            return cfg
    return None


@triton.jit(do_not_specialize=["n_pairs"])
def _align_kernel(IDS, SORTED, BLOCK_EXPERT, TOTAL, n_pairs, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  COUNT_CHUNK: tl.constexpr, PLACE_CHUNK: tl.constexpr, HIST: tl.constexpr):
    """Program e: count every expert's pairs (each program redundantly: the same latency as one
    program doing it), place e's pairs after the padded segments of experts < e, in pair order.
    HIST counts with tl.histogram, else by comparing a chunk of ids with every expert id."""
    e = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, n_pairs, COUNT_CHUNK):
        offs = start + tl.arange(0, COUNT_CHUNK)
        if HIST:  # masked ids read as expert 0, taken off its bin again
            ids = tl.load(IDS + offs, mask=offs < n_pairs, other=0).to(tl.int32)
            n_masked = tl.maximum(start + COUNT_CHUNK - n_pairs, 0)
            counts += tl.histogram(ids, E_PAD) - tl.where(experts == 0, n_masked, 0)
        else:
            ids = tl.load(IDS + offs, mask=offs < n_pairs, other=-1).to(tl.int32)
            counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    mine = experts == e
    my_count = tl.sum(tl.where(mine, counts, 0), axis=0)
    my_padded = tl.sum(tl.where(mine, padded, 0), axis=0)
    my_start = tl.sum(tl.where(mine, ends, 0), axis=0) - my_padded
    if e == 0:
        tl.store(TOTAL, tl.sum(padded, axis=0))
    placed = my_count * 0
    for start in range(0, n_pairs, PLACE_CHUNK):
        offs = start + tl.arange(0, PLACE_CHUNK)
        ids = tl.load(IDS + offs, mask=offs < n_pairs, other=-1).to(tl.int32)
        hit = (ids == e).to(tl.int32)
        pos = my_start + placed + tl.cumsum(hit, axis=0) - hit
        tl.store(SORTED + pos, offs, mask=hit == 1)
        placed += tl.sum(hit, axis=0)
    pad = my_count + tl.arange(0, BLOCK_M)
    tl.store(SORTED + my_start + pad, n_pairs + pad * 0, mask=pad < my_padded)
    first_block = my_start // BLOCK_M
    for b in range(0, my_padded // BLOCK_M):
        tl.store(BLOCK_EXPERT + first_block + b, e)


@triton.jit
def _tile_ids(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive M blocks (mostly one expert) share each weight tile."""
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _weight_ptrs(W, e, stride_we, cols, stride_wn, ks, SWAP: tl.constexpr):
    """Tile of rows `cols` of expert e's [N, K] weight: [BLOCK_K, BLOCK_N], or [BLOCK_N, BLOCK_K]
    when SWAP (the weight rows then fill the MMA's M side: a few tokens become its N side)."""
    base = W + e * stride_we
    if SWAP:
        ptrs = base + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    else:
        ptrs = base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    return ptrs


@triton.jit
def _load_weight(ptrs, col_ok, k_ok, SWAP: tl.constexpr, EVEN_K: tl.constexpr):
    if SWAP:
        if EVEN_K:
            w = tl.load(ptrs, mask=col_ok[:, None], other=0.0)
        else:
            w = tl.load(ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    else:
        if EVEN_K:
            w = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
        else:
            w = tl.load(ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)
    return w


@triton.jit
def _mma(a, w, acc, SWAP: tl.constexpr):
    """acc += a @ w, or acc^T += w @ a^T when SWAP (acc is then [BLOCK_N, BLOCK_M])."""
    if SWAP:
        out = tl.dot(w, tl.trans(a), acc)
    else:
        out = tl.dot(a, w, acc)
    return out


@triton.jit
def _acc_init(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _acc_rows(acc, SWAP: tl.constexpr):
    """The accumulator as [BLOCK_M, BLOCK_N]."""
    if SWAP:
        out = tl.trans(acc)
    else:
        out = acc
    return out


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _gate_up_kernel(X, W13, SORTED, BLOCK_EXPERT, TOTAL, ACT, n_pairs, inter, hidden, num_m,
                    stride_xt, stride_we, stride_wn, stride_at,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                    SWAP: tl.constexpr):
    """ACT[row, n] = silu(x[token(row)] . w13[e, n]) * (x[token(row)] . w13[e, I + n])."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(TOTAL):
        return
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SORTED + rows)
    valid = pairs < n_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptr = X + tokens[:, None] * stride_xt + ks[None, :]
    g_ptr = _weight_ptrs(W13, e, stride_we, cols, stride_wn, ks, SWAP)
    u_ptr = g_ptr + inter * stride_wn
    acc_g = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    acc_u = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        if EVEN_K:
            a = tl.load(a_ptr, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
        acc_g = _mma(a, _load_weight(g_ptr, col_ok, k_ok, SWAP, EVEN_K), acc_g, SWAP)
        acc_u = _mma(a, _load_weight(u_ptr, col_ok, k_ok, SWAP, EVEN_K), acc_u, SWAP)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    dtype = ACT.dtype.element_ty
    gate = _acc_rows(acc_g, SWAP).to(dtype).to(tl.float32)  # rounded like the grouped GEMM's output
    up = _acc_rows(acc_u, SWAP).to(dtype).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = ACT + rows[:, None].to(tl.int64) * stride_at + cols[None, :]
    tl.store(out, act.to(dtype), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _down_kernel(ACT, W2, SORTED, BLOCK_EXPERT, TOTAL, WEIGHTS, Y, n_pairs, hidden, inter, num_m,
                 stride_at, stride_we, stride_wn, stride_yp,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr):
    """Y[pair, n] = round(ACT[row] . w2[e, n]) * weight[pair], stored at the pair's own row."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(TOTAL):
        return
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SORTED + rows)
    valid = pairs < n_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptr = ACT + rows[:, None].to(tl.int64) * stride_at + ks[None, :]
    b_ptr = _weight_ptrs(W2, e, stride_we, cols, stride_wn, ks, SWAP)
    acc = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        if EVEN_K:
            a = tl.load(a_ptr)
        else:
            a = tl.load(a_ptr, mask=k_ok[None, :], other=0.0)
        acc = _mma(a, _load_weight(b_ptr, col_ok, k_ok, SWAP, EVEN_K), acc, SWAP)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    dtype = Y.dtype.element_ty
    w = tl.load(WEIGHTS + pairs, mask=valid, other=0.0).to(dtype).to(tl.float32)
    y = _acc_rows(acc, SWAP).to(dtype).to(tl.float32) * w[:, None]
    out = Y + pairs[:, None].to(tl.int64) * stride_yp + cols[None, :]
    tl.store(out, y.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(Y, OUT, hidden, stride_yp, stride_ot, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(TOP_K):  # slot order: fixed, so the sum is reproducible
        acc += tl.load(Y + (t * TOP_K + s) * stride_yp + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_ot + cols, acc.to(OUT.dtype.element_ty), mask=ok)


def max_padded_rows(n_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst case of sum_e ceil(count_e / BLOCK_M) * BLOCK_M (at most min(E, pairs) experts pad),
    rounded up to whole M blocks."""
    rows = n_pairs + min(num_experts, n_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def align(ids: torch.Tensor, num_experts: int, block_m: int, hist: bool = False
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [T, k] -> (sorted pair ids [max_padded] int32 (pad = T*k), expert of each M block
    [max_padded / BLOCK_M] int32, rows in use [1] int32); entries past rows in use are unset."""
    flat = ids.reshape(-1)
    n = flat.numel()
    rows = max_padded_rows(n, num_experts, block_m)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    total = torch.empty(1, dtype=torch.int32, device=ids.device)
    e_pad = max(32, triton.next_power_of_2(num_experts))  # histogram bins: a multiple of a warp
    place = max(16, min(triton.next_power_of_2(max(n, 1)), 1024))
    count = place if hist else max(16, min(place, 8192 // e_pad))
    _align_kernel[(num_experts,)](flat, sorted_ids, block_expert, total, n, BLOCK_M=block_m,
                                  E_PAD=e_pad, COUNT_CHUNK=count, PLACE_CHUNK=place, HIST=hist)
    return sorted_ids, block_expert, total


def gate_up(x: torch.Tensor, w13: torch.Tensor, routing: tuple, top_k: int, block_m: int,
            cfg: GemmConfig) -> torch.Tensor:
    """x: [T, H], w13: [E, 2I, H] -> silu(gate) * up: [max_padded, I] in sorted-pair row order."""
    sorted_ids, block_expert, total = routing
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(inter, cfg.block_n),)
    _gate_up_kernel[grid](
        x, w13, sorted_ids, block_expert, total, act, x.shape[0] * top_k, inter, hidden, num_m,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=hidden % cfg.block_k == 0, SWAP=cfg.swap_ab, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return act


def down(act: torch.Tensor, w2: torch.Tensor, routing: tuple, weights: torch.Tensor, block_m: int,
         cfg: GemmConfig) -> torch.Tensor:
    """act: [max_padded, I], w2: [E, H, I], weights: [T, k] -> weighted rows [T*k, H] (pair order)."""
    sorted_ids, block_expert, total = routing
    hidden, inter = w2.shape[1], w2.shape[2]
    flat_w = weights.reshape(-1)
    y = torch.empty(flat_w.numel(), hidden, dtype=act.dtype, device=act.device)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(hidden, cfg.block_n),)
    _down_kernel[grid](
        act, w2, sorted_ids, block_expert, total, flat_w, y, flat_w.numel(), hidden, inter, num_m,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=inter % cfg.block_k == 0, SWAP=cfg.swap_ab, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def combine(y: torch.Tensor, t: int, top_k: int) -> torch.Tensor:
    """y: [T*k, H] weighted rows -> [T, H], each token's k rows summed in slot order."""
    hidden = y.shape[1]
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(hidden))
    if t:
        _combine_kernel[(t, triton.cdiv(hidden, block))](y, out, hidden, y.stride(0), out.stride(0),
                                                        TOP_K=top_k, BLOCK=block)
    return out


def fused_expert_mlp(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """x: [T, H], ids: [T, k] (int), weights: [T, k]; w13: [E, 2I, H], w2: [E, H, I] -> [T, H].

    The same contract as grouped_experts.grouped_expert_mlp; inference only (no backward)."""
    t, k = ids.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_expert_mlp needs expert weights contiguous in their last dimension")
    if t == 0:
        return x.new_zeros(x.shape)
    routing = align(ids.contiguous(), w13.shape[0], cfg.block_m, cfg.hist_align)
    act = gate_up(x, w13, routing, k, cfg.block_m, cfg.gate_up)
    y = down(act, w2, routing, weights.contiguous(), cfg.block_m, cfg.down)
    return combine(y, t, k)
