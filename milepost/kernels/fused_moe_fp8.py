"""Fused MoE experts with FP8 blockwise weights (`--quantization fp8_block`): kernels/fused_moe.py's
four launches, the gate/up and down kernels reading float8_e4m3 expert weights and their 128 x 128
tile scales instead of bf16 weights (half the bytes a decode step reads for experts).

Weights only: activations stay in the model dtype (W8A16). Each K step multiplies the rows'
activations by the weight tile converted to the activation dtype (exact: every E4M3 value is a
bf16 value) and adds that partial product times the tile's scale (one per column) to the fp32
accumulator, so BLOCK_K must divide the 128-wide scale block. Scales, one per HF tensor's tiles:
w13 [E, 2, ceil(I/128), ceil(H/128)] (gate's, then up's: I need not be a multiple of 128),
w2 [E, ceil(H/128), ceil(I/128)]. Routing (align), rounding points, the slot-order combine and the
bitwise reproducibility are the bf16 path's; the bf16 kernels are not touched.

Row scales (a per-channel FP8 checkpoint's experts, lowprec/experts_fp8_row.py) run the same
kernels: a row scale is a block scale whose tile is one row by the whole K, so the scale index
of column n at K step k0 is (n // SCALE_N, (k0 // 128) * stride_sk) with SCALE_N = 1 and
stride_sk = 0 (scales w13 [E, 2, I, 1], w2 [E, H, 1]); block scales have SCALE_N = 128.

Prescaled (`PRESCALE_FROM_TOKENS`): from that many tokens on, each K step scales the weight tile
instead, rounds it to the activation dtype (the weights the torch path dequantizes to) and lets
the MMA accumulate into the accumulator directly, as the bf16 kernels do: the values are then the
bf16 kernels' on those dequantized weights, bit for bit. Scaling each partial product makes every
K step wait for its MMA to finish; on a GPU that costs most where the tiles are large (T=4096 on
an H200: 2,009 µs against bf16's 831). Off until measured (benchmarks/moe_fp8_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from milepost.kernels import fused_moe as fm
from milepost.kernels.fused_moe import (
    GemmConfig,
    MoeConfig,
    _acc_init,
    _acc_rows,
    _load_weight,
    _mma,
    _tile_ids,
    _weight_ptrs,
)

SCALE_BLOCK = 128
# Token counts from which the W8A16 kernels scale the weight tiles (module docstring); None: never.
PRESCALE_FROM_TOKENS: int | None = None

# Configs measured for the FP8 kernels, per expert shape (experts, hidden, moe_intermediate, top_k):
# (largest token count, config), ascending (benchmarks/moe_fp8_gpu.py sweeps them). Shapes and
# token counts not listed run the bf16 table's tiles (fused_moe.MEASURED) with BLOCK_K <= 128.
MEASURED_FP8: dict[tuple[int, int, int, int], tuple[tuple[int, MoeConfig], ...]] = {}


def _c(block_m: int, gu: tuple, dn: tuple, hist: bool = True) -> MoeConfig:
    """gu / dn: (block_n, block_k, num_warps, num_stages, swap_ab)."""
    return MoeConfig(block_m, GemmConfig(*gu[:4], 8, gu[4]), GemmConfig(*dn[:4], 8, dn[4]), hist)


# Where neither table has the shape (a config changes speed, never values): the bf16 sweep's
# 30B-A3B choices (fused_moe.MEASURED, 2026-12-04) with BLOCK_K <= 128.
_DEFAULT: tuple[tuple[int, MoeConfig], ...] = (
    (1, _c(16, (32, 128, 4, 4, False), (128, 128, 4, 3, True), hist=False)),
    (128, _c(16, (64, 128, 4, 3, True), (64, 128, 4, 3, True))),
    (256, _c(32, (64, 128, 4, 3, False), (64, 128, 4, 3, True))),
    (1024, _c(64, (64, 64, 4, 4, False), (128, 64, 4, 3, False))),
    (4096, _c(128, (128, 64, 8, 4, False), (256, 64, 8, 3, False))),
)

# benchmarks/moe_fp8_gpu.py --parts kernel on one H100 (2026-12-05, session 17; the same best config
# at 1, 16, 64 and 128 tokens). With it the 30B-A3B engine's FP8 decode step was x1.30 bf16's.
MEASURED_FP8[(128, 2048, 768, 8)] = (  # Qwen3-30B-A3B
    (128, _c(16, (32, 128, 4, 4, False), (64, 128, 4, 3, False))),
    (256, _c(32, (64, 128, 4, 3, True), (64, 128, 4, 3, False))),
    (1024, _c(64, (64, 128, 4, 3, True), (64, 128, 4, 3, True))),
    (4096, _c(128, (64, 64, 4, 4, False), (64, 128, 4, 3, True))),
)


def _fit(cfg: MoeConfig) -> MoeConfig:
    """The config with each GEMM's BLOCK_K within one scale block."""
    def gemm(g: GemmConfig) -> GemmConfig:
        if g.block_k <= SCALE_BLOCK:
            return g
        return GemmConfig(g.block_n, SCALE_BLOCK, g.num_warps, g.num_stages, g.group_m, g.swap_ab)

    return MoeConfig(cfg.block_m, gemm(cfg.gate_up), gemm(cfg.down), cfg.hist_align)


def config_for(tokens: int, num_experts: int, hidden: int, inter: int, top_k: int) -> MoeConfig:
    """The FP8 config for `tokens` (smallest bucket that holds it; past the last, the last).
    Unlike the bf16 path there is no grouped-GEMM alternative: every shape gets a config."""
    key = (num_experts, hidden, inter, top_k)
    table = MEASURED_FP8.get(key) or tuple((n, c) for n, c in fm.MEASURED.get(key, ()) if c) or _DEFAULT
    for max_tokens, cfg in table:
        if tokens <= max_tokens:
            return _fit(cfg)
    return _fit(table[-1][1])


@triton.jit
def _scaled_mma(a, w, s, acc, SWAP: tl.constexpr):
    """acc += (a @ w) * s per column, or acc^T += (w @ a^T) * s per row when SWAP."""
    if SWAP:
        out = acc + tl.dot(w, tl.trans(a)) * s[:, None]
    else:
        out = acc + tl.dot(a, w) * s[None, :]
    return out


@triton.jit
def _w8_mma(a, w8, s, acc, SWAP: tl.constexpr, PRESCALE: tl.constexpr):
    """acc += a @ (w8 * s) for an fp8 weight tile with per-column scales s: the exact product
    scaled, or, PRESCALE, the tile scaled and rounded to a's dtype first."""
    if PRESCALE:
        if SWAP:
            w = (w8.to(tl.float32) * s[:, None]).to(a.dtype)
        else:
            w = (w8.to(tl.float32) * s[None, :]).to(a.dtype)
        out = _mma(a, w, acc, SWAP)
    else:
        out = _scaled_mma(a, w8.to(a.dtype), s, acc, SWAP)
    return out


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _gate_up_fp8_kernel(X, W13, S13, SORTED, BLOCK_EXPERT, TOTAL, ACT, n_pairs, inter, hidden, num_m,
                        stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sh, stride_sn,
                        stride_sk, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                        SWAP: tl.constexpr, SCALE_N: tl.constexpr, PRESCALE: tl.constexpr):
    """ACT[row, n] = silu(x . deq(w13[e, n])) * (x . deq(w13[e, I + n])), fp8 weights."""
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
    sg_ptr = S13 + e * stride_se + (cols // SCALE_N) * stride_sn  # [BLOCK_N]: gate's tile row
    su_ptr = sg_ptr + stride_sh
    acc_g = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    acc_u = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = ks < hidden - k0
        if EVEN_K:
            a = tl.load(a_ptr, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptr, mask=valid[:, None] & k_ok[None, :], other=0.0)
        sg = tl.load(sg_ptr + (k0 // 128) * stride_sk, mask=col_ok, other=0.0)
        su = tl.load(su_ptr + (k0 // 128) * stride_sk, mask=col_ok, other=0.0)
        acc_g = _w8_mma(a, _load_weight(g_ptr, col_ok, k_ok, SWAP, EVEN_K), sg, acc_g, SWAP, PRESCALE)
        acc_u = _w8_mma(a, _load_weight(u_ptr, col_ok, k_ok, SWAP, EVEN_K), su, acc_u, SWAP, PRESCALE)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    dtype = ACT.dtype.element_ty
    gate = _acc_rows(acc_g, SWAP).to(dtype).to(tl.float32)  # rounded like the bf16 path
    up = _acc_rows(acc_u, SWAP).to(dtype).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = ACT + rows[:, None].to(tl.int64) * stride_at + cols[None, :]
    tl.store(out, act.to(dtype), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _down_fp8_kernel(ACT, W2, S2, SORTED, BLOCK_EXPERT, TOTAL, WEIGHTS, Y, n_pairs, hidden, inter, num_m,
                     stride_at, stride_we, stride_wn, stride_yp, stride_se, stride_sn, stride_sk,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                     SCALE_N: tl.constexpr, PRESCALE: tl.constexpr):
    """Y[pair, n] = round(ACT[row] . deq(w2[e, n])) * weight[pair], fp8 weights."""
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
    s_ptr = S2 + e * stride_se + (cols // SCALE_N) * stride_sn
    acc = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = ks < inter - k0
        if EVEN_K:
            a = tl.load(a_ptr)
        else:
            a = tl.load(a_ptr, mask=k_ok[None, :], other=0.0)
        s = tl.load(s_ptr + (k0 // 128) * stride_sk, mask=col_ok, other=0.0)
        acc = _w8_mma(a, _load_weight(b_ptr, col_ok, k_ok, SWAP, EVEN_K), s, acc, SWAP, PRESCALE)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    dtype = Y.dtype.element_ty
    wt = tl.load(WEIGHTS + pairs, mask=valid, other=0.0).to(dtype).to(tl.float32)
    y = _acc_rows(acc, SWAP).to(dtype).to(tl.float32) * wt[:, None]
    out = Y + pairs[:, None].to(tl.int64) * stride_yp + cols[None, :]
    tl.store(out, y.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _scaled_mma_a8(a, w, sa, sw, acc, SWAP: tl.constexpr):
    """FP8 x FP8: acc += (a @ w) * sa per row * sw per column (SWAP: transposed, as _scaled_mma)."""
    if SWAP:
        out = acc + tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
    else:
        out = acc + tl.dot(a, w) * (sa[:, None] * sw[None, :])
    return out


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _gate_up_a8_kernel(XQ, XS, W13, S13, SORTED, BLOCK_EXPERT, TOTAL, ACT, n_pairs, inter, hidden, num_m,
                       stride_xt, stride_xsm, stride_xsk, stride_we, stride_wn, stride_at,
                       stride_se, stride_sh, stride_sn,
                       TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SWAP: tl.constexpr):
    """The gate/up kernel on FP8 activations (1 x 128 per token, XQ / XS) and FP8 weights:
    both tensor-core operands fp8, no conversion in the K loop. hidden % BLOCK_K == 0."""
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
    a_ptr = XQ + tokens[:, None] * stride_xt + ks[None, :]
    sa_ptr = XS + tokens * stride_xsm
    g_ptr = _weight_ptrs(W13, e, stride_we, cols, stride_wn, ks, SWAP)
    u_ptr = g_ptr + inter * stride_wn
    sg_ptr = S13 + e * stride_se + (cols // 128) * stride_sn
    su_ptr = sg_ptr + stride_sh
    acc_g = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    acc_u = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, hidden, BLOCK_K):
        a = tl.load(a_ptr, mask=valid[:, None], other=0.0)
        sa = tl.load(sa_ptr + (k0 // 128) * stride_xsk, mask=valid, other=0.0)
        sg = tl.load(sg_ptr + k0 // 128, mask=col_ok, other=0.0)
        su = tl.load(su_ptr + k0 // 128, mask=col_ok, other=0.0)
        acc_g = _scaled_mma_a8(a, _load_weight(g_ptr, col_ok, ks, SWAP, True), sa, sg, acc_g, SWAP)
        acc_u = _scaled_mma_a8(a, _load_weight(u_ptr, col_ok, ks, SWAP, True), sa, su, acc_u, SWAP)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K
        u_ptr += BLOCK_K
    dtype = ACT.dtype.element_ty
    gate = _acc_rows(acc_g, SWAP).to(dtype).to(tl.float32)
    up = _acc_rows(acc_u, SWAP).to(dtype).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = ACT + rows[:, None].to(tl.int64) * stride_at + cols[None, :]
    tl.store(out, act.to(dtype), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _down_a8_kernel(AQ, AS, W2, S2, SORTED, BLOCK_EXPERT, TOTAL, WEIGHTS, Y, n_pairs, hidden, inter, num_m,
                    stride_at, stride_asm, stride_ask, stride_we, stride_wn, stride_yp, stride_se,
                    stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, SWAP: tl.constexpr):
    """The down kernel on FP8 activation rows (1 x 128, AQ / AS) and FP8 weights."""
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
    a_ptr = AQ + rows[:, None].to(tl.int64) * stride_at + ks[None, :]
    sa_ptr = AS + rows.to(tl.int64) * stride_asm
    b_ptr = _weight_ptrs(W2, e, stride_we, cols, stride_wn, ks, SWAP)
    s_ptr = S2 + e * stride_se + (cols // 128) * stride_sn
    acc = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, inter, BLOCK_K):
        a = tl.load(a_ptr)
        sa = tl.load(sa_ptr + (k0 // 128) * stride_ask)
        sw = tl.load(s_ptr + k0 // 128, mask=col_ok, other=0.0)
        acc = _scaled_mma_a8(a, _load_weight(b_ptr, col_ok, ks, SWAP, True), sa, sw, acc, SWAP)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    dtype = Y.dtype.element_ty
    wt = tl.load(WEIGHTS + pairs, mask=valid, other=0.0).to(dtype).to(tl.float32)
    y = _acc_rows(acc, SWAP).to(dtype).to(tl.float32) * wt[:, None]
    out = Y + pairs[:, None].to(tl.int64) * stride_yp + cols[None, :]
    tl.store(out, y.to(dtype), mask=valid[:, None] & col_ok[None, :])


def _check_k(cfg: GemmConfig) -> None:
    if SCALE_BLOCK % cfg.block_k:
        raise ValueError(f"FP8 expert GEMMs need BLOCK_K dividing {SCALE_BLOCK}, got {cfg.block_k}")


def _scale_layout(s: torch.Tensor, rows: bool, cfg: GemmConfig) -> tuple[int, int]:
    """(SCALE_N, stride_sk) of block scales (128 x 128 tiles: BLOCK_K must stay in one) or of
    row scales (one per row for the whole K: the K index never moves)."""
    if rows:
        return 1, 0
    _check_k(cfg)
    return SCALE_BLOCK, s.stride(-1)


def gate_up(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, routing: tuple, top_k: int,
            block_m: int, cfg: GemmConfig, row_scales: bool = False, prescale: bool = False) -> torch.Tensor:
    """x: [T, H], w13: fp8 [E, 2I, H], s13: [E, 2, ceil(I/128), ceil(H/128)] (`row_scales`:
    [E, 2, I, 1]) -> silu(gate) * up: [max_padded, I] in sorted-pair row order. `prescale`: the
    weight tiles scaled before the MMA (module docstring)."""
    scale_n, stride_sk = _scale_layout(s13, row_scales, cfg)
    sorted_ids, block_expert, total = routing
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(inter, cfg.block_n),)
    _gate_up_fp8_kernel[grid](
        x, w13, s13, sorted_ids, block_expert, total, act, x.shape[0] * top_k, inter, hidden, num_m,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), s13.stride(0), s13.stride(1),
        s13.stride(2), stride_sk, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k == 0,
        SWAP=cfg.swap_ab, SCALE_N=scale_n, PRESCALE=prescale, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return act


def down(act: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, routing: tuple, weights: torch.Tensor,
         block_m: int, cfg: GemmConfig, row_scales: bool = False, prescale: bool = False) -> torch.Tensor:
    """act: [max_padded, I], w2: fp8 [E, H, I], s2: [E, ceil(H/128), ceil(I/128)] (`row_scales`:
    [E, H, 1]), weights: [T, k] -> weighted rows [T*k, H] (pair order)."""
    scale_n, stride_sk = _scale_layout(s2, row_scales, cfg)
    sorted_ids, block_expert, total = routing
    hidden, inter = w2.shape[1], w2.shape[2]
    flat_w = weights.reshape(-1)
    y = torch.empty(flat_w.numel(), hidden, dtype=act.dtype, device=act.device)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(hidden, cfg.block_n),)
    _down_fp8_kernel[grid](
        act, w2, s2, sorted_ids, block_expert, total, flat_w, y, flat_w.numel(), hidden, inter, num_m,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0), s2.stride(0), s2.stride(1),
        stride_sk, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=inter % cfg.block_k == 0, SWAP=cfg.swap_ab, SCALE_N=scale_n, PRESCALE=prescale,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def gate_up_a8(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, routing: tuple, top_k: int,
               block_m: int, cfg: GemmConfig) -> torch.Tensor:
    """gate_up with x quantized per token in 1 x 128 blocks first (the activation quantizer's
    bits); hidden % 128 == 0."""
    from milepost.kernels.fp8_quant import quantize_act_1x128

    _check_k(cfg)
    sorted_ids, block_expert, total = routing
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    xq, xs = quantize_act_1x128(x)
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(inter, cfg.block_n),)
    _gate_up_a8_kernel[grid](
        xq, xs, w13, s13, sorted_ids, block_expert, total, act, x.shape[0] * top_k, inter, hidden,
        num_m, xq.stride(0), xs.stride(0), xs.stride(1), w13.stride(0), w13.stride(1), act.stride(0),
        s13.stride(0), s13.stride(1), s13.stride(2), TOP_K=top_k, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, SWAP=cfg.swap_ab,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return act


def down_a8(act: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, routing: tuple, weights: torch.Tensor,
            block_m: int, cfg: GemmConfig) -> torch.Tensor:
    """down with the activation rows quantized per row in 1 x 128 blocks first; inter % 128 == 0."""
    from milepost.kernels.fp8_quant import quantize_act_1x128

    _check_k(cfg)
    sorted_ids, block_expert, total = routing
    hidden, inter = w2.shape[1], w2.shape[2]
    aq, as_ = quantize_act_1x128(act)
    flat_w = weights.reshape(-1)
    y = torch.empty(flat_w.numel(), hidden, dtype=act.dtype, device=act.device)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(hidden, cfg.block_n),)
    _down_a8_kernel[grid](
        aq, as_, w2, s2, sorted_ids, block_expert, total, flat_w, y, flat_w.numel(), hidden, inter,
        num_m, aq.stride(0), as_.stride(0), as_.stride(1), w2.stride(0), w2.stride(1), y.stride(0),
        s2.stride(0), s2.stride(1), BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SWAP=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def fused_expert_mlp_fp8(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                         s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                         cfg: MoeConfig, act_fp8: bool = False, row_scales: bool = False,
                         prescale: bool | None = None) -> torch.Tensor:
    """x: [T, H], ids: [T, k] (int), weights: [T, k]; w13: fp8 [E, 2I, H] with s13, w2: fp8
    [E, H, I] with s2 (shapes above; `row_scales`: one scale per row) -> [T, H].
    fused_moe.fused_expert_mlp's contract, its weights the dequantized fp8 ones; inference only.
    `prescale` (W8A16): None follows PRESCALE_FROM_TOKENS."""
    if act_fp8 and row_scales:
        raise ValueError("fused_expert_mlp_fp8: the W8A8 kernels read 128 x 128 "
                         "block scales only, not row scales")
    t, k = ids.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_expert_mlp_fp8 needs expert weights contiguous in their last dimension")
    if t == 0:
        return x.new_zeros(x.shape)
    s13, s2 = s13.contiguous(), s2.contiguous()
    routing = fm.align(ids.contiguous(), w13.shape[0], cfg.block_m, cfg.hist_align)
    if act_fp8:  # --fp8-w8a8-experts: activations in FP8 too, W8A8
        act = gate_up_a8(x, w13, s13, routing, k, cfg.block_m, cfg.gate_up)
        y = down_a8(act, w2, s2, routing, weights.contiguous(), cfg.block_m, cfg.down)
    else:
        if prescale is None:
            prescale = PRESCALE_FROM_TOKENS is not None and t >= PRESCALE_FROM_TOKENS
        act = gate_up(x, w13, s13, routing, k, cfg.block_m, cfg.gate_up, row_scales, prescale)
        y = down(act, w2, s2, routing, weights.contiguous(), cfg.block_m, cfg.down, row_scales, prescale)
    return fm.combine(y, t, k)
