"""Paged and varlen attention backends against a naive float64 reference on random tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from milepost.models.attention import PagedBatch, PagedKVCache, TorchPagedAttention, VarlenCausalAttention
from milepost.models.base import AttentionBackend

D = 8
SCALE = D**-0.5


def naive_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One full sequence: q [L, H, D], k/v [L, Hkv, D] -> [L, H, D], in float64, GQA by repetition."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def random_seqs(lens: list[int], h: int, hkv: int, layers: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        [tuple(torch.randn(n, heads, D, generator=g) for heads in (h, hkv, hkv)) for _ in range(layers)]
        for n in lens
    ]


def shuffled_block_tables(lens: list[int], block_size: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Non-contiguous tables using every block (so block 0, the padding id, also holds real data)."""
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed)).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i : i + n])
        i += n
    return tables, sum(need)


@pytest.mark.parametrize("h,hkv", [(4, 2), (4, 4), (6, 1)])
def test_varlen_matches_naive(h: int, hkv: int) -> None:
    lens = [5, 1, 12, 7]
    seqs = random_seqs(lens, h, hkv)
    q, k, v = (torch.cat([s[0][j] for s in seqs]) for j in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    out = VarlenCausalAttention(cu).attend(0, q, k, v, SCALE)
    ref = torch.cat([naive_causal(*s[0], SCALE) for s in seqs])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_varlen_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="cu_seqlens"):
        VarlenCausalAttention(torch.tensor([0, 3, 3]))
    att = VarlenCausalAttention(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="tokens"):
        att.attend(0, *(torch.zeros(4, 2, D) for _ in range(3)), SCALE)


def run_schedule(lens: list[int], steps: list[list[int]], h: int, hkv: int, block_size: int, strip_cpu=False):
    """Feed each sequence through the paged backend in the given chunks (steps[s][i] new tokens of
    sequence i, 0 = absent); returns per-sequence outputs [L, H, D] per layer, and the reference."""
    layers = 2
    seqs = random_seqs(lens, h, hkv, layers=layers)
    tables, num_blocks = shuffled_block_tables(lens, block_size)
    cache = PagedKVCache(layers, num_blocks, block_size, hkv, D, torch.float32, "cpu")
    att = TorchPagedAttention(cache)
    done = [0] * len(lens)
    outs = [[[] for _ in range(layers)] for _ in lens]
    for step in steps:
        members = [i for i, n in enumerate(step) if n]
        batch = PagedBatch.build(
            [step[i] for i in members],
            [done[i] + step[i] for i in members],
            [tables[i] for i in members],
            block_size,
        )
        if strip_cpu:  # the backend must also work from the tensors alone
            batch = dataclasses.replace(batch, seq_lens_cpu=None, query_lens_cpu=None)
        att.prepare(batch)
        for layer in range(layers):
            new = [[t[done[i] : done[i] + step[i]] for t in seqs[i][layer]] for i in members]
            q, k, v = (torch.cat([n[j] for n in new]) for j in range(3))
            out = att.attend(layer, q, k, v, SCALE)
            assert out.shape == q.shape
            start = 0
            for i in members:
                outs[i][layer].append(out[start : start + step[i]])
                start += step[i]
        for i in members:
            done[i] += step[i]
    assert done == lens, "schedule must cover every token"
    got = [[torch.cat(o) for o in per_layer] for per_layer in outs]
    ref = [[naive_causal(*seqs[i][layer], SCALE) for layer in range(layers)] for i in range(len(lens))]
    return got, ref


def assert_all_close(got, ref) -> None:
    for g_seq, r_seq in zip(got, ref):
        for g, r in zip(g_seq, r_seq):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h,hkv", [(4, 2), (2, 2), (4, 1)])
def test_paged_full_prefill_across_block_boundaries(h: int, hkv: int) -> None:
    lens = [1, 4, 5, 9, 16]
    assert_all_close(*run_schedule(lens, [lens], h, hkv, block_size=4))


def test_paged_decode_only_steps() -> None:
    lens = [5, 8, 11]
    # After a prefill of unequal lengths, every step is pure decode over different KV lengths
    # (so the padded tail of the gathered KV must be masked).
    steps = [[2, 5, 3]] + [[1, 1, 1]] * 3 + [[0, 0, 1]] * 5
    assert_all_close(*run_schedule(lens, steps, 4, 2, block_size=4))


def test_paged_chunked_and_mixed_batches() -> None:
    lens = [13, 9, 11]
    steps = [
        [6, 7, 0],  # sequence 0 prefills a first chunk, sequence 1 its whole prompt
        [4, 1, 5],  # second chunk of 0 while 1 decodes and 2 starts
        [1, 1, 6],  # 0 and 1 decode, 2 finishes its prompt in a chunk crossing blocks
        [1, 0, 0],
        [1, 0, 0],
    ]
    assert_all_close(*run_schedule(lens, steps, 4, 2, block_size=4))
    assert_all_close(*run_schedule(lens, steps, 4, 2, block_size=4, strip_cpu=True))


def test_paged_block_size_one_and_large() -> None:
    lens = [5, 3]
    steps = [[2, 3], [3, 0]]
    assert_all_close(*run_schedule(lens, steps, 4, 2, block_size=1))
    assert_all_close(*run_schedule(lens, steps, 4, 2, block_size=64))


def test_paged_batch_build_layout() -> None:
    batch = PagedBatch.build([2, 1], [5, 3], [[7, 2], [4]], block_size=4)
    assert batch.query_start_loc.tolist() == [0, 2, 3]
    assert batch.seq_lens.tolist() == [5, 3]
    assert batch.block_tables.tolist() == [[7, 2], [4, 0]]
    # seq 0 positions 3, 4 -> block 7 offset 3, block 2 offset 0; seq 1 position 2 -> block 4 offset 2
    assert batch.slot_mapping.tolist() == [31, 8, 18]
    assert batch.positions.tolist() == [3, 4, 2]


def test_paged_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="slots"):
        PagedBatch.build([1], [9], [[0, 1]], block_size=4)
    with pytest.raises(ValueError, match="query_len"):
        PagedBatch.build([3], [2], [[0]], block_size=4)
    att = TorchPagedAttention(PagedKVCache(1, 2, 4, 1, D, torch.float32, "cpu"))
    assert isinstance(att, AttentionBackend) and isinstance(VarlenCausalAttention(torch.tensor([0, 1])), AttentionBackend)
    with pytest.raises(RuntimeError, match="prepare"):
        att.attend(0, *(torch.zeros(1, 1, D) for _ in range(3)), SCALE)


def test_cache_nbytes() -> None:
    cache = PagedKVCache(3, 5, 4, 2, D, torch.bfloat16, "cpu")
    assert cache.nbytes() == 2 * 3 * (5 * 4 * 2 * D) * 2
    assert cache.k[0].shape == (20, 2, D) and cache.num_blocks == 5 and cache.block_size == 4


def test_paged_short_chunks_share_one_call_and_match_the_reference() -> None:
    """Verify-sized chunks (2-16 new tokens, SHORT_QUERY) go through one padded call beside decode
    rows and a long chunk; at the boundary 16 tokens are short and 17 are a prefill chunk."""
    from milepost.models.attention import SHORT_QUERY

    assert SHORT_QUERY == 16
    lens = [30, 21, 40, 12, 50]
    steps = [
        [20, 17, 6, 5, 16],  # prefill chunks, one of them exactly 17 and one 16 tokens
        [4, 1, 3, 2, 1],  # verify-like chunks of unequal lengths beside decodes
        [2, 3, 17, 1, 16],  # short chunks, a 17-token chunk and a 16-token chunk in one step
        [4, 0, 14, 4, 17],
    ]
    assert [sum(s[i] for s in steps) for i in range(len(lens))] == lens
    for h, hkv in ((4, 2), (4, 1), (2, 2)):
        assert_all_close(*run_schedule(lens, steps, h, hkv, block_size=4))
    assert_all_close(*run_schedule(lens, steps, 4, 2, block_size=4, strip_cpu=True))
