"""Host-side forward layout: numpy builder vs per-token reference, CUDA-graph padding, grouped experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from milepost.engine.forward_batch import (
    DecodeBuffers,
    build_flat,
    capture_sizes,
    fill_decode,
    padded_size,
)
from milepost.engine.request import Request
from milepost.engine.sampling import SamplingParams
from milepost.engine.scheduler import Chunk
from milepost.kernels.grouped_experts import grouped_expert_mlp
from milepost.models.qwen3_moe import StackedExperts

BS = 4


def _req(rid: str, prompt: list[int], out: list[int], blocks: list[int]) -> Request:
    r = Request(rid=rid, prompt_ids=prompt, params=SamplingParams(), on_output=lambda o: None,
                stop_ids=frozenset())
    r.output_ids = list(out)
    r.blocks = list(blocks)
    return r


def _chunks() -> list[Chunk]:
    a = _req("a", list(range(10, 19)), [], [7, 2, 5])  # prefill of 9 tokens, 2 cached
    b = _req("b", [3, 4, 5], [6, 8], [1, 9])  # decode: position 4
    c = _req("c", list(range(30, 40)), [], [0, 3, 4])  # mid-prompt chunk: does not sample
    return [Chunk(a, 2, 7), Chunk(b, 4, 1), Chunk(c, 0, 6)]


def test_build_flat_matches_per_token_layout() -> None:
    chunks = _chunks()
    flat = build_flat(chunks, BS)
    ids, pos, slots = [], [], []
    for ch in chunks:
        for p in range(ch.start, ch.start + ch.length):
            ids.append(ch.req.all_ids[p])
            pos.append(p)
            slots.append(ch.req.blocks[p // BS] * BS + p % BS)
    assert flat.input_ids.tolist() == ids
    assert flat.positions.tolist() == pos
    assert flat.slots.tolist() == slots
    assert flat.query_start_loc.tolist() == [0, 7, 8, 14]
    assert flat.seq_lens.tolist() == [9, 5, 6]
    assert flat.block_tables.tolist() == [[7, 2, 5], [1, 9, 0], [0, 3, 4]]
    assert flat.sample_rows == [6, 7]  # a and b reach their ends; c stops mid-prompt


def test_padded_size_picks_the_next_captured_size() -> None:
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256
    assert sizes == sorted(set(sizes))
    assert padded_size(1, sizes) == 1
    assert padded_size(3, sizes) == 4
    assert padded_size(17, sizes) == 24
    assert padded_size(256, sizes) == 256
    assert padded_size(257, sizes) is None
    assert capture_sizes(12)[-1] == 12 and capture_sizes(1) == [1]
    with pytest.raises(ValueError, match="max batch size"):
        capture_sizes(0)


def test_fill_decode_writes_rows_and_padding() -> None:
    host = np.full(8 * (4 + 3), 99, dtype=np.int32)
    buf = DecodeBuffers.over(host, 8, 3)
    b = _req("b", [3, 4, 5], [6, 8], [1, 9])
    d = _req("d", [1], [2, 3, 4, 5, 6], [4, 6])
    fill_decode(buf, [Chunk(b, 4, 1), Chunk(d, 5, 1)], 4, BS)
    assert buf.ids[:4].tolist() == [8, 6, 0, 0]
    assert buf.positions[:2].tolist() == [4, 5]
    assert buf.slots[:4].tolist() == [9 * BS, 6 * BS + 1, -1, -1]
    assert buf.seq_lens[:4].tolist() == [5, 6, 0, 0]
    assert buf.tables[0, :2].tolist() == [1, 9] and buf.tables[1, :2].tolist() == [4, 6]
    too_long = _req("e", [1] * 20, [], [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="captured for 3"):
        fill_decode(buf, [Chunk(too_long, 19, 1)], 1, BS)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_experts_match_the_per_expert_loop(dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(0)
    experts = StackedExperts(6, 16, 8)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(6, 16, 16, generator=g) * 0.3)
        experts.w2.copy_(torch.randn(6, 16, 8, generator=g) * 0.3)
    experts = experts.to(dtype)
    x = torch.randn(11, 16, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(11)])
    ids[:, 0] = 2  # one crowded expert, some empty ones
    w = torch.rand(11, 3, generator=g).to(dtype)
    with torch.no_grad():
        ref = experts(x, ids, w)  # CPU: the loop
        got = grouped_expert_mlp(x, ids, w, experts.w13, experts.w2)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
