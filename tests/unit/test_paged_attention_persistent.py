"""The persistent unsplit decode kernel (milepost/kernels/paged_attention_persistent.py): bit for
bit the unsplit kernel's output, whatever the items per program and the sequence lengths (empty
graph-padding rows included), and compiled for sm_90 its key and value tiles go through the
pipelined 16-byte async copies. Its speed waits for a GPU (benchmarks/decode_attention_sweep.py).

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernels are imported); there in fp32 (the interpreter's bf16 dots are not the GPU's).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pa = importlib.import_module("milepost.kernels.paged_attention")
pp = importlib.import_module("milepost.kernels.paged_attention_persistent")

from milepost.models.attention import PagedBatch
from milepost.testing.hopper_compile import needs_ptxas, run_compiled

torch.set_num_threads(1)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
PAGE, D = 4, 32


def test_programs_fill_one_wave_evenly() -> None:
    assert pp.persistent_programs(2048, 132, 2) == 256  # 8 items each, not 264 of 7.76
    assert pp.persistent_programs(2048, 132, 1) == 128  # 16 each
    assert pp.persistent_programs(10, 132, 2) == 10  # fewer items than slots: one each
    assert pp.persistent_programs(14, 2, 2) == 4  # 4, 4, 3, 3
    assert pp.persistent_programs(1, 1, 1) == 1


def _batch(seq_lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // PAGE)) for n in seq_lens]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    batch = PagedBatch.build([1] * len(seq_lens), [max(1, n) for n in seq_lens], tables, PAGE,
                             device=DEV)
    batch.seq_lens[torch.tensor(seq_lens) == 0] = 0  # a graph batch's padding rows
    slots = (sum(need) + 2) * PAGE
    k = torch.randn(slots, 2, D, generator=g).to(DTYPE).to(DEV)
    v = torch.randn(slots, 2, D, generator=g).to(DTYPE).to(DEV)
    q = torch.randn(len(seq_lens), 4, D, generator=g).to(DTYPE).to(DEV)
    return batch, k, v, q


@pytest.mark.parametrize("per_sm", [1, 2, 8])
def test_equals_the_unsplit_kernel_bit_for_bit(per_sm: int) -> None:
    # lengths around the 16-key tile edges, an empty (padding) row first, middle and last
    seq_lens = [0, 1, 15, 16, 17, 37, 0, 64, 5, 0]
    batch, k, v, q = _batch(seq_lens, seed=per_sm)
    want = pa.paged_decode(q, k, v, batch.block_tables, batch.seq_lens, D**-0.5, PAGE, 1,
                           block_n=16)
    got = torch.full_like(q, float("nan"))
    pp.persistent_decode(q, k, v, batch.block_tables, batch.seq_lens, D**-0.5, PAGE, got,
                         block_n=16, per_sm=per_sm)
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 6, 9]], torch.zeros_like(got[[0, 6, 9]]))


def test_paged_decode_takes_it_behind_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    batch, k, v, q = _batch([3, 20, 9], seed=5)
    want = pa.paged_decode(q, k, v, batch.block_tables, batch.seq_lens, D**-0.5, PAGE, 1,
                           block_n=16)
    monkeypatch.setattr(pa, "PERSISTENT_DECODE", True)
    got = pa.paged_decode(q, k, v, batch.block_tables, batch.seq_lens, D**-0.5, PAGE, 1,
                          block_n=16)
    assert torch.equal(got, want)


_SASS = """
import re
from milepost.kernels import paged_attention_persistent as m
from milepost.testing.hopper_compile import sm90_sass
sass = sm90_sass(m._decode_persistent_kernel,
                 {"Q": "*bf16", "KC": "*bf16", "VC": "*bf16", "tables": "*i32", "seq_lens": "*i32",
                  "Out": "*bf16"},
                 {"KV_HEADS": 8, "GROUP": 2, "BLOCK_H": 16, "D": 128, "PAGE": 16, "BLOCK_N": 64,
                  "IEEE": False}, 2, 3)
assert re.search(r"LDGSTS\\.E\\.BYPASS\\.128", sass), "tiles not moved by 16-byte async copies"
assert "HMMA.16816.F32.BF16" in sass
print("ok")
"""


@needs_ptxas()
def test_compiles_for_sm90_with_async_tile_copies() -> None:
    run_compiled(_SASS)
