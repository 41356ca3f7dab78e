"""Fused MoE experts with packed INT4 weights (`--quantization int4`, W4A16): kernels/fused_moe.py's
four launches, the gate/up and down kernels reading the INT4 expert store (lowprec/experts_int4.py:
uint8 bytes of two's-complement nibbles, element 2i in the low nibble, and a float32 scale per 128
weights of a row; with zero points, an AWQ or asymmetric GPTQ / compressed-tensors checkpoint
served as stored, an int8 zero point laid out as the scales) and unpacking and scaling them in
registers, so a decode step reads half a byte per expert weight instead of bf16's two.

Each K step builds the weight tile as dequantize_packed does (nibble times its group's scale in
float32, rounded once to the activation dtype; with zero points (nibble - zero) * scale, the
difference exact, as int4_gemm's dense kernels compute it) and hands it to the bf16 kernels'
tl.dot: the same products, tiles and rounding points (gate/up and down outputs in the model dtype,
silu * up, the weighted rows, the slot-order combine) as fused_moe.fused_expert_mlp on the
dequantized weights with the same config. Bitwise, since config_for keeps 64 rows or more on the
MMA's M side (with fewer, Hopper's compiler orders the sums of a tile built in registers
differently; _fit says what was measured). BLOCK_K divides the 128-wide group, so a K step
reads one scale per weight row. Routing (fused_moe.align) and the combine are the bf16 path's; nothing syncs with the host (CUDA graphs capture it).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from milepost.kernels import fused_moe as fm
from milepost.kernels.fused_moe import GemmConfig, MoeConfig, _acc_init, _acc_rows, _mma, _tile_ids

log = logging.getLogger(__name__)
GROUP = 128  # weights per float32 scale along a row (lowprec/formats.py INT4_GROUP)
# Token counts up to which the INT4 experts take these kernels (decode batches); past it, prefill:
# every expert is dequantized once and the bf16 path multiplies (compute-bound there). A rule
# like int4_gemm.INT4_DECODE_M's, not measured yet (benchmarks/int4_moe_gpu.py times 1 ... 256).
MAX_TOKENS = 256
_OK: dict[int, bool] = {}  # device index -> whether the kernels passed their probe there

# Configs measured for these kernels per expert shape (experts, hidden, moe_intermediate, top_k):
# (largest token count, config), ascending; benchmarks/int4_moe_gpu.py --sweep prints the table.
# Shapes not listed take the bf16 table's tiles (fused_moe.MEASURED: the same tiles on the same
# products) with BLOCK_K fitted to a group, else _DEFAULT.
MEASURED_INT4: dict[tuple[int, int, int, int], tuple[tuple[int, MoeConfig], ...]] = {}


def _c(block_m: int, gu: tuple, dn: tuple, hist: bool = True) -> MoeConfig:
    """gu / dn: (block_n, block_k, num_warps, num_stages, swap_ab)."""
    return MoeConfig(block_m, GemmConfig(*gu[:4], 8, gu[4]), GemmConfig(*dn[:4], 8, dn[4]), hist)


# Weight rows on the MMA's M side (swap_ab): the tile built in registers is the operand that may
# stay there; a few tokens fill the N side.
_DEFAULT: tuple[tuple[int, MoeConfig], ...] = (
    (1, _c(16, (32, 128, 4, 4, True), (64, 128, 4, 3, True), hist=False)),
    (MAX_TOKENS, _c(16, (64, 128, 4, 3, True), (64, 128, 4, 3, True))),
)

# Qwen3-30B-A3B's experts on an H200 (2026-12-06; 0.97x bf16's time at 1 token, 1.18-1.29x
# faster at 4-64, 1.19x at 256; every config keeps 64+ weight rows on the MMA's M side).
MEASURED_INT4[(128, 2048, 768, 8)] = (
    (1, _c(16, (64, 128, 4, 3, True), (64, 128, 4, 3, True), hist=False)),
    (4, _c(16, (64, 128, 4, 3, True), (64, 128, 4, 3, True), hist=True)),
    (16, _c(16, (64, 128, 4, 3, True), (128, 128, 4, 3, True), hist=True)),
    (64, _c(16, (64, 128, 4, 3, True), (128, 128, 4, 3, True), hist=True)),
    (256, _c(32, (64, 64, 4, 4, True), (128, 128, 4, 3, True), hist=True)),
)


# The MMA's M side (weight rows when swap_ab, else token rows) that keeps these kernels' bits the
# bf16 kernels' on the same config. On an H100 (2026-12-06, benchmarks/gpu_steps/diag_int4_bits.py,
# 4, 100 and 256 tokens, both GEMMs, block_m x block_n x stages x swap_ab): bitwise in all 30
# cases where that side had 64 rows or more, in none of the 42 where it had fewer (off by up to
# 3e-2 in gate/up): the compiler sums a tile built in registers in another order there.
MMA_M_MIN = 64


def _fit(cfg: MoeConfig) -> MoeConfig:
    """The config with each GEMM's BLOCK_K a divisor of the 128-wide group (at most 128) and at
    least MMA_M_MIN rows on the MMA's M side: a GEMM whose token rows (block_m) are fewer takes the
    weight rows there (swap_ab, block_n >= MMA_M_MIN)."""
    def gemm(g: GemmConfig) -> GemmConfig:
        k = g.block_k if g.block_k <= GROUP and GROUP % g.block_k == 0 else GROUP
        swap, n = g.swap_ab, g.block_n
        if (n if swap else cfg.block_m) < MMA_M_MIN:
            swap, n = True, max(n, MMA_M_MIN)
        return GemmConfig(n, k, g.num_warps, g.num_stages, g.group_m, swap)

    return MoeConfig(cfg.block_m, gemm(cfg.gate_up), gemm(cfg.down), cfg.hist_align)


def config_for(tokens: int, num_experts: int, hidden: int, inter: int, top_k: int) -> MoeConfig:
    """The config for `tokens` (smallest bucket that holds it; past the last, the last)."""
    key = (num_experts, hidden, inter, top_k)
    table = (MEASURED_INT4.get(key) or tuple((n, c) for n, c in fm.MEASURED.get(key, ()) if c)
             or _DEFAULT)
    for max_tokens, cfg in table:
        if tokens <= max_tokens:
            return _fit(cfg)
    return _fit(table[-1][1])


@triton.jit
def _w4_tile(W_E, S_E, Z_E, cols, col_ok, stride_wn, stride_sn, k0, n_bytes, dtype: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, ZERO: tl.constexpr):
    """K step k0 of rows `cols` of one expert's packed weight (bytes from W_E, scales from S_E,
    where ZERO int8 zero points from Z_E, laid out as the scales), dequantized: nibble * scale
    (ZERO: (nibble - zero) * scale) in float32, cast to `dtype`. [BLOCK_N, BLOCK_K] when SWAP,
    else [BLOCK_K, BLOCK_N]: built in the orientation _mma takes (no transpose of the tile).
    n ^ 8 is the nibble's value + 8; OR-ed into the bits of 2^23 it is the float32 2^23 + v + 8
    exactly, and subtracting 2^23 + 8 leaves v (int4_gemm._nibbles' trick: no int -> float
    conversion, a quarter-rate op). With a zero point z (-8..8) the subtrahend is 2^23 + 8 + z,
    an integer below 2^24 (exact), so the difference is v - z exactly and the one rounding is
    the scale product's, as dequantize's (v - z) * s. Bytes past the row (an odd K's pad) read
    as 0."""
    bb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    rows = W_E + cols.to(tl.int64) * stride_wn
    s = tl.load(S_E + cols.to(tl.int64) * stride_sn + k0 // 128, mask=col_ok, other=0.0)
    if ZERO:
        z = tl.load(Z_E + cols.to(tl.int64) * stride_sn + k0 // 128, mask=col_ok, other=0)
        off = z.to(tl.float32) + 8388616.0  # [BLOCK_N]: 2^23 + 8 + zero, exact
    if SWAP:
        b = tl.load(rows[:, None] + bb[None, :], mask=col_ok[:, None] & (bb < n_bytes)[None, :],
                    other=0).to(tl.int32)
        u = tl.reshape(tl.join((b & 15) ^ 8, (b >> 4) ^ 8), (BLOCK_N, BLOCK_K))  # 2i low, 2i+1 high
        if ZERO:
            w = ((u | 0x4B000000).to(tl.float32, bitcast=True) - off[:, None]) * s[:, None]
        else:
            w = ((u | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s[:, None]
    else:
        b = tl.load(rows[None, :] + bb[:, None], mask=col_ok[None, :] & (bb < n_bytes)[:, None],
                    other=0).to(tl.int32)
        u = tl.join((b & 15) ^ 8, (b >> 4) ^ 8)  # [BLOCK_K / 2, BLOCK_N, 2]: K rows 2i, 2i + 1
        u = tl.reshape(tl.permute(u, (0, 2, 1)), (BLOCK_K, BLOCK_N))
        if ZERO:
            w = ((u | 0x4B000000).to(tl.float32, bitcast=True) - off[None, :]) * s[None, :]
        else:
            w = ((u | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * s[None, :]
    return w.to(dtype)


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _gate_up_w4_kernel(X, W13, S13, Z13, SORTED, BLOCK_EXPERT, TOTAL, ACT, n_pairs, inter, hidden,
                       num_m, n_bytes, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                       stride_at, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                       SWAP: tl.constexpr, ZERO: tl.constexpr):
    """ACT[row, n] = silu(x . deq(w13[e, n])) * (x . deq(w13[e, I + n])), packed INT4 weights
    (ZERO: Z13 holds zero points laid out as S13; else Z13 is unused)."""
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
    g_w, g_s = W13 + e * stride_we, S13 + e * stride_se  # gate rows; up rows are I further
    u_w, u_s = g_w + inter * stride_wn, g_s + inter * stride_sn
    g_z = Z13 + e * stride_se  # zero points share the scales' strides
    u_z = g_z + inter * stride_sn
    dtype = ACT.dtype.element_ty
    acc_g = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    acc_u = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptr, mask=valid[:, None] & (ks < hidden - k0)[None, :], other=0.0)
        wg = _w4_tile(g_w, g_s, g_z, cols, col_ok, stride_wn, stride_sn, k0, n_bytes, dtype,
                      BLOCK_N, BLOCK_K, SWAP, ZERO)
        acc_g = _mma(a, wg, acc_g, SWAP)
        wu = _w4_tile(u_w, u_s, u_z, cols, col_ok, stride_wn, stride_sn, k0, n_bytes, dtype,
                      BLOCK_N, BLOCK_K, SWAP, ZERO)
        acc_u = _mma(a, wu, acc_u, SWAP)
        a_ptr += BLOCK_K
    gate = _acc_rows(acc_g, SWAP).to(dtype).to(tl.float32)  # rounded like the bf16 path
    up = _acc_rows(acc_u, SWAP).to(dtype).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = ACT + rows[:, None].to(tl.int64) * stride_at + cols[None, :]
    tl.store(out, act.to(dtype), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _down_w4_kernel(ACT, W2, S2, Z2, SORTED, BLOCK_EXPERT, TOTAL, WEIGHTS, Y, n_pairs, hidden,
                    inter, num_m, n_bytes, stride_at, stride_we, stride_wn, stride_se, stride_sn,
                    stride_yp, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
                    ZERO: tl.constexpr):
    """Y[pair, n] = round(ACT[row] . deq(w2[e, n])) * weight[pair], packed INT4 weights
    (ZERO: Z2 holds zero points laid out as S2; else Z2 is unused)."""
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
    dtype = Y.dtype.element_ty
    acc = _acc_init(BLOCK_M, BLOCK_N, SWAP)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptr)
        else:
            a = tl.load(a_ptr, mask=(ks < inter - k0)[None, :], other=0.0)
        w = _w4_tile(W2 + e * stride_we, S2 + e * stride_se, Z2 + e * stride_se, cols, col_ok,
                     stride_wn, stride_sn, k0, n_bytes, dtype, BLOCK_N, BLOCK_K, SWAP, ZERO)
        acc = _mma(a, w, acc, SWAP)
        a_ptr += BLOCK_K
    wt = tl.load(WEIGHTS + pairs, mask=valid, other=0.0).to(dtype).to(tl.float32)
    y = _acc_rows(acc, SWAP).to(dtype).to(tl.float32) * wt[:, None]
    out = Y + pairs[:, None].to(tl.int64) * stride_yp + cols[None, :]
    tl.store(out, y.to(dtype), mask=valid[:, None] & col_ok[None, :])


def _check(cfg: GemmConfig) -> None:
    if cfg.block_k > GROUP or GROUP % cfg.block_k or cfg.block_k < 16:
        raise ValueError(f"INT4 expert GEMMs need BLOCK_K dividing {GROUP} (16 or more), "
                         f"got {cfg.block_k}")


def _zero_layout(name: str, scales: torch.Tensor, zeros: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros or scales) for a kernel launch: the kernels read zero points with the
    scales' strides, so both are made contiguous; without zero points the scales stand in for the
    unused pointer."""
    if zeros is None:
        return scales, scales
    if zeros.dtype != torch.int8 or zeros.shape != scales.shape:
        raise ValueError(f"INT4 expert zero points {name}: {zeros.dtype} {tuple(zeros.shape)}; "
                         f"expected int8 shaped as the scales {tuple(scales.shape)}")
    return scales.contiguous(), zeros.contiguous()


def gate_up(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, routing: tuple, top_k: int,
            block_m: int, cfg: GemmConfig, z13: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H], w13: uint8 [E, 2I, ceil(H/2)], s13: float32 [E, 2I, ceil(H/128)] (z13: int8
    zero points shaped as s13, or None) -> silu(gate) * up: [max_padded, I] in sorted-pair row
    order."""
    _check(cfg)
    s13, z_arg = _zero_layout("z13", s13, z13)
    sorted_ids, block_expert, total = routing
    inter, hidden = w13.shape[1] // 2, x.shape[1]
    act = torch.empty(sorted_ids.numel(), inter, dtype=x.dtype, device=x.device)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(inter, cfg.block_n),)
    _gate_up_w4_kernel[grid](
        x, w13, s13, z_arg, sorted_ids, block_expert, total, act, x.shape[0] * top_k, inter, hidden,
        num_m, w13.shape[2], x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), act.stride(0), TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=hidden % cfg.block_k == 0,
        SWAP=cfg.swap_ab, ZERO=z13 is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return act


def down(act: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, routing: tuple, weights: torch.Tensor,
         block_m: int, cfg: GemmConfig, z2: torch.Tensor | None = None) -> torch.Tensor:
    """act: [max_padded, I], w2: uint8 [E, H, ceil(I/2)], s2: float32 [E, H, ceil(I/128)] (z2:
    int8 zero points shaped as s2, or None), weights: [T, k] -> weighted rows [T*k, H] (pair
    order)."""
    _check(cfg)
    s2, z_arg = _zero_layout("z2", s2, z2)
    sorted_ids, block_expert, total = routing
    hidden, inter = w2.shape[1], act.shape[1]
    flat_w = weights.reshape(-1)
    y = torch.empty(flat_w.numel(), hidden, dtype=act.dtype, device=act.device)
    num_m = block_expert.numel()
    grid = (num_m * triton.cdiv(hidden, cfg.block_n),)
    _down_w4_kernel[grid](
        act, w2, s2, z_arg, sorted_ids, block_expert, total, flat_w, y, flat_w.numel(), hidden, inter,
        num_m, w2.shape[2], act.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        y.stride(0), BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=inter % cfg.block_k == 0, SWAP=cfg.swap_ab, ZERO=z2 is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def fused_expert_mlp_int4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                          w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                          cfg: MoeConfig, z13: torch.Tensor | None = None,
                          z2: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H], ids: [T, k] (int), weights: [T, k]; the INT4 store's w13 uint8 [E, 2I, ceil(H/2)]
    with s13 float32 [E, 2I, ceil(H/128)], w2 uint8 [E, H, ceil(I/2)] with s2 [E, H, ceil(I/128)]
    and, for a checkpoint with zero points, z13 / z2 int8 shaped as s13 / s2 (each group's zero
    point - 8; None: symmetric) -> [T, H] in x's dtype. fused_moe.fused_expert_mlp's contract on
    the dequantized weights; inference only."""
    t, k = ids.shape
    hidden, inter = x.shape[1], w13.shape[1] // 2
    want = {"w13": (-(-hidden // 2), -(-hidden // GROUP)), "w2": (-(-inter // 2), -(-inter // GROUP))}
    for name, (packed, scales) in {"w13": (w13, s13), "w2": (w2, s2)}.items():
        if (packed.shape[-1], scales.shape[-1]) != want[name] or packed.dtype != torch.uint8:
            raise ValueError(f"fused_expert_mlp_int4: {name} {packed.dtype} {tuple(packed.shape)} with "
                             f"scales {tuple(scales.shape)} is not the packed INT4 store of hidden "
                             f"{hidden}, intermediate {inter} (uint8 [.., {want[name][0]}], "
                             f"scales [.., {want[name][1]}])")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if t == 0:
        return x.new_zeros(x.shape)
    w13, s13, w2, s2 = (a.contiguous() for a in (w13, s13, w2, s2))
    routing = fm.align(ids.contiguous(), w13.shape[0], cfg.block_m, cfg.hist_align)
    act = gate_up(x, w13, s13, routing, k, cfg.block_m, cfg.gate_up, z13)
    y = down(act, w2, s2, routing, weights.contiguous(), cfg.block_m, cfg.down, z2)
    return fm.combine(y, t, k)


def kernel_ok(device: torch.device) -> bool:
    """Whether the fused INT4 MoE kernels give the dequantized experts' product on `device`
    (probed once, at start: odd hidden and intermediate sizes with partial groups, group scales
    six orders of magnitude apart, both default configs, without and with zero points; a failure
    is logged and the experts keep the dequantize-then-bf16 path)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _OK:
        _OK[idx] = _probe(torch.device("cuda", idx))
    return _OK[idx]


def _probe(device: torch.device) -> bool:
    from milepost.lowprec.experts_int4 import dequantize_packed
    from milepost.lowprec.quantize import quantize

    g = torch.Generator().manual_seed(0)
    e, h, i, k, t = 5, 2 * GROUP + 72 + 1, GROUP + 40 + 1, 2, 9
    spread = torch.logspace(-3, 3, h)[torch.randperm(h, generator=g)]
    w13 = torch.randn(e, 2 * i, h, generator=g) * spread * 0.02
    w2 = torch.randn(e, h, i, generator=g) * 0.05
    q13, q2 = quantize(w13, "int4"), quantize(w2, "int4")
    s13, s2 = q13.scales.reshape(e, 2 * i, -1), q2.scales.reshape(e, h, -1)
    x = torch.randn(t, h, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g).bfloat16()
    # Zero points as AWQ's (zero - 8 in -8..7; asymmetric GPTQ v1's up to 8), per row and group:
    # one read from the wrong group, row or expert shows.
    z13 = torch.randint(-8, 9, tuple(s13.shape), generator=g, dtype=torch.int8)
    z2 = torch.randint(-8, 9, tuple(s2.shape), generator=g, dtype=torch.int8)
    args = [a.to(device) for a in (x, ids, wts, q13.values, s13, q2.values, s2)]
    try:
        for zeros in ((None, None), (z13, z2)):
            d13 = dequantize_packed(q13.values, s13, h, torch.bfloat16, zeros[0]).float()
            d2 = dequantize_packed(q2.values, s2, i, torch.bfloat16, zeros[1]).float()
            gate, up = torch.einsum("th,tknh->tkn", x.float(), d13[ids]).chunk(2, -1)
            ref = torch.einsum("tkn,tkhn->tkh", torch.nn.functional.silu(gate) * up, d2[ids])
            ref = (ref * wts.float()[..., None]).sum(1)
            dz = [z.to(device) if z is not None else None for z in zeros]
            for tokens, cfg in _DEFAULT:
                n = min(t, tokens)
                got = fused_expert_mlp_int4(args[0][:n], args[1][:n], args[2][:n], *args[3:], cfg,
                                            *dz).float().cpu()
                err = ((got - ref[:n]).norm() / ref[:n].norm()).item()
                if not err < 2e-2:  # bf16 rounding of the intermediates: ~4e-3
                    raise ValueError(f"{cfg.label()} ({'with' if dz[0] is not None else 'without'} "
                                     f"zero points): relative error {err:.3g} against the "
                                     "dequantized product")
    except Exception as exc:  # noqa: BLE001 - a compile error or a wrong product: never use them
        log.warning("int4: the fused W4A16 MoE kernels failed their probe on %s (%s); INT4 experts "
                    "dequantize the routed experts into model-dtype copies and run the bf16 MoE "
                    "kernels instead (no faster than bf16 at decode)", device, exc)
        return False
    return True
