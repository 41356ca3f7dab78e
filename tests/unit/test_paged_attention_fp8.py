"""The word-loading decode kernel over an fp8 KV pool (milepost/kernels/paged_attention_fp8.py):
the integer widening is exact for every e4m3 byte, the kernel is attention over the pool's
values, and compiled for sm_90 it moves the pool by 16-byte copies with no per-value conversion
instructions (what it was written for: on an H200 it is 1.05-1.13x the widening kernel).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernels are imported).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
tl = importlib.import_module("triton.language")
pa = importlib.import_module("milepost.kernels.paged_attention")
fp8k = importlib.import_module("milepost.kernels.paged_attention_fp8")

from milepost.models.attention import PagedBatch, PagedKVCache, to_cache
from milepost.testing.hopper_compile import needs_ptxas, run_compiled

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
PAGE, D = 4, 64


@triton.jit
def _widen_all(W, O, N: tl.constexpr):
    w = tl.load(W + tl.arange(0, N))
    for j in tl.static_range(4):
        tl.store(O + tl.arange(0, N) * 4 + j, fp8k._widen(w, j))


def test_widening_is_exact_for_every_e4m3_byte() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256, dtype=torch.float16, device=DEV)
    _widen_all[(1,)](codes.to(DEV).view(torch.int32), out, N=64)
    got = out.cpu().float() * 256
    want = codes.view(FP8).float()
    nan = want.isnan()
    assert nan.sum() == 2  # 0x7F and 0xFF: widen to +-480 (documented)
    assert torch.equal(got[~nan], want[~nan])  # subnormals and both zeros included
    assert torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))
    assert got[nan].abs().tolist() == [480.0, 480.0]


def _pool(seq_lens: list[int], h: int, hkv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // PAGE) for n in seq_lens]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    batch = PagedBatch.build([1] * len(seq_lens), seq_lens, tables, PAGE, device=DEV)
    pool = PagedKVCache(1, sum(need) + 2, PAGE, hkv, D, FP8, DEV)
    for part in (pool.k[0], pool.v[0]):
        part.copy_(to_cache(torch.randn(part.shape, generator=g) * 4, FP8).to(DEV))
    pool.k[0][0, 0, :3] = torch.tensor([448.0, -0.001953125, -0.0], dtype=FP8)  # max, subnormal
    q = (torch.randn(len(seq_lens), h, D, generator=g) * 2).to(torch.bfloat16).to(DEV)
    return pool, batch, q


def _reference(pool: PagedKVCache, batch: PagedBatch, q: torch.Tensor) -> torch.Tensor:
    """Softmax attention of each row's query over its keys, in fp64 from the pool's values."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // pool.k[0].shape[1]
    for b, n in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[b].tolist()
        slots = [blocks[p // PAGE] * PAGE + p % PAGE for p in range(n)]
        k = pool.k[0][slots].double().cpu()
        v = pool.v[0][slots].double().cpu()
        for h in range(q.shape[1]):
            s = (k[:, h // group] @ q[b, h].double().cpu()) * D**-0.5
            out[b, h] = torch.softmax(s, 0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("splits", [1, 2])
def test_word_kernel_is_attention_over_the_pool_values(splits: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    seq_lens = [1, 6, 19, 37]
    pool, batch, q = _pool(seq_lens, 4, 2, seed=splits)
    ref = _reference(pool, batch, q)
    calls = []  # which kernel paged_decode launches: the word kernel's launcher counts its calls
    launch = fp8k.launch_fp8_words
    monkeypatch.setattr(fp8k, "launch_fp8_words", lambda *a, **kw: (calls.append(1), launch(*a, **kw)))
    assert pa.FP8_POOL_WORDS  # the default
    out = pa.paged_decode(q, pool.k[0], pool.v[0], batch.block_tables, batch.seq_lens,
                          D**-0.5, PAGE, splits, block_n=16)
    assert calls == [1]
    # fp16 probabilities and a bf16 output: within their rounding of the fp64 attention
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=1e-2)
    # and the padding rows of a graph batch (seq_len 0) give zeros
    zero = pa.paged_decode(q, pool.k[0], pool.v[0], batch.block_tables,
                           torch.zeros_like(batch.seq_lens), D**-0.5, PAGE, splits, block_n=16)
    assert torch.equal(zero, torch.zeros_like(zero))
    assert calls == [1, 1]
    # the switch off sends the pool to paged_attention.py's widening kernel (whose fp8 loads only
    # a GPU runs: tests/gpu/test_lowprec_cuda.py)
    monkeypatch.setattr(pa, "FP8_POOL_WORDS", False)
    pa.paged_decode(q, pool.k[0], pool.v[0], batch.block_tables, batch.seq_lens, D**-0.5, PAGE,
                    splits, block_n=16)
    assert calls == [1, 1]


_SASS = """
import re
from milepost.kernels import paged_attention_fp8 as m
from milepost.testing.hopper_compile import sm90_sass
sass = sm90_sass(m._decode_fp8_words_kernel,
                 {"Q": "*bf16", "KW": "*i32", "VW": "*i32", "tables": "*i32", "seq_lens": "*i32",
                  "O_part": "*fp32", "L_part": "*fp32", "Out": "*bf16"},
                 {"GROUP": 2, "BLOCK_H": 16, "D": 128, "PAGE": 16, "BLOCK_N": 64, "NUM_SPLITS": 1,
                  "QUANT": False}, 2, 3)
assert re.search(r"LDGSTS\\.E\\.BYPASS\\.128|LDG\\.E\\.128", sass), "pool not moved 16 bytes a copy"
assert not re.search(r"\\bF2F\\.|F2FP\\.F16\\.E4M3|LDS\\.U8", sass), "per-value conversions or byte loads"
assert "HMMA.16816.F32" in sass  # fp16 tensor-core dots
print("ok")
"""


@needs_ptxas()
def test_word_kernel_compiles_for_sm90_without_per_value_conversions() -> None:
    run_compiled(_SASS)
