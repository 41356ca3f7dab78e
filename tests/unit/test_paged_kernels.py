"""Triton paged-attention kernels against the torch reference backend, on random caches.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernels are imported), so the indexing, masking and split merging are checked on CPU too.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
kernels = importlib.import_module("milepost.kernels.paged_attention")

from milepost.models.attention import PagedBatch, PagedKVCache, TorchPagedAttention
from milepost.testing.hopper_compile import needs_ptxas, run_compiled

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PAGE, D = 4, 16


def _setup(q_lens: list[int], seq_lens: list[int], h: int, hkv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in seq_lens]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()  # shuffled, non-contiguous blocks
    tables, i = [], 0
    for n in need:
        tables.append(perm[i : i + n])
        i += n
    cache = PagedKVCache(1, sum(need) + 3, PAGE, hkv, D, torch.float32, DEV)
    cache.k[0].normal_(generator=None)
    cache.v[0].normal_()
    t = sum(q_lens)
    q = torch.randn(t, h, D, generator=g).to(DEV)
    k = torch.randn(t, hkv, D, generator=g).to(DEV)
    v = torch.randn(t, hkv, D, generator=g).to(DEV)
    batch = PagedBatch.build(q_lens, seq_lens, tables, PAGE, device=DEV)
    return cache, batch, q, k, v


def _reference(cache: PagedKVCache, batch: PagedBatch, q, k, v) -> torch.Tensor:
    ref_cache = PagedKVCache(1, cache.num_blocks, PAGE, cache.num_kv_heads, D, torch.float32, DEV)
    ref_cache.k[0].copy_(cache.k[0])
    ref_cache.v[0].copy_(cache.v[0])
    att = TorchPagedAttention(ref_cache)
    att.prepare(batch)
    return att.attend(0, q, k, v, D**-0.5)


@pytest.mark.parametrize("h,hkv,splits", [(4, 2, 1), (4, 2, 4), (3, 3, 2)])
def test_decode_kernel_matches_reference(h: int, hkv: int, splits: int) -> None:
    seq_lens = [1, 7, 33, 70]
    cache, batch, q, k, v = _setup([1] * 4, seq_lens, h, hkv, seed=splits)
    ref = _reference(cache, batch, q, k, v)
    kernels.store_kv(cache.k[0], cache.v[0], k, v, batch.slot_mapping)
    out = kernels.paged_decode(q, cache.k[0], cache.v[0], batch.block_tables, batch.seq_lens,
                               D**-0.5, PAGE, splits, block_n=16)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_decode_padding_rows_give_zeros_and_write_nothing() -> None:
    cache, batch, q, k, v = _setup([1, 1], [5, 9], 4, 2, seed=3)
    before = cache.k[0].clone()
    slots = torch.tensor([-1, -1], device=DEV)
    kernels.store_kv(cache.k[0], cache.v[0], k, v, slots)
    assert torch.equal(cache.k[0], before)
    out = kernels.paged_decode(q, cache.k[0], cache.v[0], batch.block_tables,
                               torch.zeros(2, dtype=torch.int64, device=DEV), D**-0.5, PAGE, 2, block_n=16)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("q_lens,seq_lens", [([9, 1, 5], [9, 14, 5]), ([3, 11], [40, 11])])
def test_prefill_kernel_matches_reference_with_cached_prefixes(q_lens, seq_lens) -> None:
    cache, batch, q, k, v = _setup(q_lens, seq_lens, 4, 2, seed=len(q_lens))
    ref = _reference(cache, batch, q, k, v)
    kernels.store_kv(cache.k[0], cache.v[0], k, v, batch.slot_mapping)
    seqs, starts = kernels.prefill_tiles(q_lens, block_m=16)
    out = kernels.paged_prefill(
        q, cache.k[0], cache.v[0], batch.block_tables, batch.seq_lens, batch.query_start_loc,
        torch.tensor(seqs, dtype=torch.int32, device=DEV),
        torch.tensor(starts, dtype=torch.int32, device=DEV), D**-0.5, PAGE, block_m=16, block_n=16,
    )
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("splits", [1, 2])
def test_mixed_batch_decode_rows_through_the_decode_kernel(splits: int) -> None:
    # A mixed step: three decodes first (the scheduler's order), then a fresh prompt and a
    # chunk over a cached prefix; the decode kernel writes rows 0-2, the prefill tiles the rest.
    q_lens, seq_lens = [1, 1, 1, 9, 5], [7, 33, 70, 9, 14]
    cache, batch, q, k, v = _setup(q_lens, seq_lens, 4, 2, seed=11)
    ref = _reference(cache, batch, q, k, v)
    kernels.store_kv(cache.k[0], cache.v[0], k, v, batch.slot_mapping)
    n = kernels.leading_decodes(q_lens)
    assert n == 3
    out = torch.full_like(q, float("nan"))
    kernels.paged_decode(q[:n], cache.k[0], cache.v[0], batch.block_tables[:n], batch.seq_lens[:n],
                         D**-0.5, PAGE, splits, block_n=16, out=out[:n])
    seqs, starts = kernels.prefill_tiles(q_lens, block_m=16, first=n)
    assert seqs == [3, 4] and starts == [0, 0]
    res = kernels.paged_prefill(
        q, cache.k[0], cache.v[0], batch.block_tables, batch.seq_lens, batch.query_start_loc,
        torch.tensor(seqs, dtype=torch.int32, device=DEV),
        torch.tensor(starts, dtype=torch.int32, device=DEV), D**-0.5, PAGE, block_m=16, block_n=16,
        out=out,
    )
    assert res is out
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def _fp8_pool(q_lens: list[int], seq_lens: list[int], seed: int):
    """An fp8 pool, with the fp32 reference over the pool's values (fp32 queries: Triton's
    interpreter widens e4m3 to fp32 exactly; its bf16 widening is not what a GPU computes)."""
    from milepost.models.attention import to_cache

    cache, batch, q, k, v = _setup(q_lens, seq_lens, 4, 2, seed=seed)
    for part in (cache.k[0], cache.v[0]):  # the prior tokens as the fp8 pool holds them
        part.copy_(to_cache(part * 3, FP8).float())
    k8, v8 = to_cache(k * 3, FP8), to_cache(v * 3, FP8)
    ref = _reference(cache, batch, q, k8.float(), v8.float())
    pool = PagedKVCache(1, cache.num_blocks, PAGE, 2, D, FP8, DEV)
    for part, prior, new in ((pool.k[0], cache.k[0], k8), (pool.v[0], cache.v[0], v8)):
        part.copy_(prior.to(FP8))
        part[batch.slot_mapping] = new
    return pool, batch, q, ref


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_over_an_fp8_pool_is_attention_over_its_values(splits: int) -> None:
    pool, batch, q, ref = _fp8_pool([1] * 4, [1, 7, 33, 70], seed=5)
    out = kernels.paged_decode(q, pool.k[0], pool.v[0], batch.block_tables, batch.seq_lens,
                               D**-0.5, PAGE, splits, block_n=16)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_prefill_over_an_fp8_pool_is_attention_over_its_values() -> None:
    q_lens, seq_lens = [9, 1, 5], [9, 14, 5]
    pool, batch, q, ref = _fp8_pool(q_lens, seq_lens, seed=6)
    seqs, starts = kernels.prefill_tiles(q_lens, block_m=16)
    out = kernels.paged_prefill(
        q, pool.k[0], pool.v[0], batch.block_tables, batch.seq_lens, batch.query_start_loc,
        torch.tensor(seqs, dtype=torch.int32, device=DEV),
        torch.tensor(starts, dtype=torch.int32, device=DEV), D**-0.5, PAGE, block_m=16, block_n=16,
    )
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_leading_decodes_counts_only_the_front() -> None:
    assert kernels.leading_decodes([1, 1, 9, 1]) == 2
    assert kernels.leading_decodes([9, 1]) == 0
    assert kernels.leading_decodes([1]) == 1


def test_prefill_tiles_cover_every_row_once() -> None:
    seqs, starts = kernels.prefill_tiles([5, 130, 1], block_m=64)
    assert seqs == [0, 1, 1, 1, 2]
    assert starts == [0, 0, 64, 128, 0]


def test_decode_splits_fill_the_gpu_and_stay_powers_of_two() -> None:
    assert kernels.decode_splits(256, 8, 132) == 1
    assert kernels.decode_splits(1, 8, 132) == 32
    s = kernels.decode_splits(8, 8, 132)
    assert s & (s - 1) == 0 and 8 * 8 * s >= 2 * 132


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("with_norm", [True, False])
def test_rope_store_equals_norm_rope_then_store_kv(dtype: torch.dtype, with_norm: bool) -> None:
    """One launch (q/k norm + RoPE, the KV store) gives the bits of the three it replaces."""
    fused = importlib.import_module("milepost.kernels.fused_ops")
    g = torch.Generator().manual_seed(5)
    t, h, hkv, slots = 5, 6, 3, 24  # 6 / 3 heads: not powers of two (masked head rows)
    qkv = (torch.randn(t, (h + 2 * hkv) * D, generator=g) * 40).to(torch.bfloat16).to(DEV)
    freqs = torch.rand(t, D // 2, generator=g) * 6
    cos, sin = (torch.cat([f, f], -1).to(torch.bfloat16).to(DEV) for f in (freqs.cos(), freqs.sin()))
    qw, kw = ((torch.rand(D, generator=g) + 0.5).to(torch.bfloat16).to(DEV) if with_norm else None
              for _ in range(2))
    slot_ids = torch.tensor([7, -1, 0, 23, 12], device=DEV)  # -1: a padding row, stores nothing
    want_k, want_v = (torch.zeros(slots, hkv, D, device=DEV).to(dtype) for _ in range(2))
    got_k, got_v = want_k.clone(), want_v.clone()
    q, k, v = qkv.split([h * D, hkv * D, hkv * D], dim=-1)
    want_q = fused.norm_rope(q.view(t, h, D), qw, 1e-6, cos, sin)
    kernels.store_kv(want_k, want_v, fused.norm_rope(k.view(t, hkv, D), kw, 1e-6, cos, sin),
                     v.view(t, hkv, D), slot_ids)
    got_q = kernels.rope_store(qkv, h, hkv, qw, kw, 1e-6, cos, sin, got_k, got_v, slot_ids)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    assert got_k.view(torch.uint8)[1:7].eq(0).all()  # slots no row names stay untouched


_COMPILE_ROPE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from milepost.kernels import fused_ops, paged_attention
const = {"HALF": 64, "HAS_NORM": True}
kernels = (
    (fused_ops._norm_rope_kernel, {"X": "*bf16", "W": "*bf16", "COS": "*bf16", "SIN": "*bf16",
                                   "Y": "*bf16"}, {**const, "HEADS": 16}),
    (paged_attention._rope_store_kernel, {"QKV": "*bf16", "QW": "*bf16", "KW": "*bf16",
                                          "COS": "*bf16", "SIN": "*bf16", "QO": "*bf16",
                                          "KC": "*bf16", "VC": "*bf16", "slots": "*i64"},
     {**const, "HQ": 16, "HKV": 8, "SATURATE": False, "SPLIT": 0}),
    (paged_attention._rope_store_kernel, {"QKV": "*fp32", "QW": "*bf16", "KW": "*bf16",  # parts
                                          "COS": "*bf16", "SIN": "*bf16", "QO": "*bf16",
                                          "KC": "*fp8e4nv", "VC": "*fp8e4nv", "slots": "*i64"},
     {**const, "HQ": 16, "HKV": 8, "SATURATE": True, "SPLIT": 3}),
)
for fn, ptrs, c in kernels:
    sig = {n: ptrs.get(n, "constexpr" if n in c else ("fp32" if n == "eps" else "i32"))
           for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, c), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert k.asm["cubin"], fn
print("compiled")
"""


@needs_ptxas()
def test_rope_kernels_compile_for_sm90() -> None:
    """norm_rope and rope_store share one jit helper: both still compile for an H100/H200, the
    latter also over a split GEMM's fp32 parts into an fp8 pool."""
    run_compiled(_COMPILE_ROPE)


_COMPILE_DECODE = """
from milepost.kernels import paged_attention
from milepost.testing.hopper_compile import compile_sm90
ptrs = {"Q": "*bf16", "KC": "*bf16", "VC": "*bf16", "tables": "*i32", "seq_lens": "*i32",
        "O_part": "*fp32", "L_part": "*fp32", "Out": "*bf16"}
c = {"GROUP": 2, "BLOCK_H": 16, "D": 128, "PAGE": 16, "BLOCK_N": 64, "NUM_SPLITS": 1, "IEEE": False}
for quant in (False, True):  # the output stored, or quantized for an FP8 o_proj
    p = {**ptrs, "QV": "*fp8e4nv" if quant else "*bf16", "QS": "*fp32" if quant else "*bf16"}
    k = compile_sm90(paged_attention._decode_split_kernel, p, {**c, "QUANT": quant}, 2, 3,
                     floats=("scale",))
    assert k.asm["cubin"]
from milepost.kernels import paged_attention_fp8  # the fp8 pool's kernel, quantizing its output
p = {**ptrs, "KW": "*i32", "VW": "*i32", "QV": "*fp8e4nv", "QS": "*fp32"}
c.pop("IEEE")
k = compile_sm90(paged_attention_fp8._decode_fp8_words_kernel, p, {**c, "QUANT": True}, 2, 3,
                 floats=("scale",))
assert k.asm["cubin"]
"""


@needs_ptxas()
def test_decode_kernel_compiles_for_sm90() -> None:
    """Both decode kernels, the fp8 pool's with its output quantized for an FP8 o_proj."""
    run_compiled(_COMPILE_DECODE)
