"""The P2P transfer plan, the packed-bucket layout, and the expert pass of the bucketing."""

from __future__ import annotations

import pytest
import torch

from milepost.weights.bucket import bucket_meta, iter_update_buckets
from milepost.weights.p2p_layout import (
    ALIGN,
    StagingBuffer,
    flat_layout,
    transfer_plan,
    unpack,
)


def test_plan_maps_one_to_one_then_spreads_the_rest_evenly() -> None:
    assert transfer_plan(4, 4) == [[0], [1], [2], [3]]
    assert transfer_plan(3, 8) == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert transfer_plan(5, 2) == [[0], [1], [], [], []]  # surplus sources sit idle
    plan = transfer_plan(7, 100)
    sizes = [len(p) for p in plan]
    assert max(sizes) - min(sizes) <= 1 and sorted(t for p in plan for t in p) == list(range(100))


def test_packed_layout_round_trips_mixed_dtypes() -> None:
    bucket = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)),
              ("c", torch.arange(9, dtype=torch.int64).reshape(3, 3)), ("d", torch.randn(0))]
    offsets, total = flat_layout([t.shape for _, t in bucket], [t.dtype for _, t in bucket])
    assert all(o % ALIGN == 0 for o in offsets)
    staging = StagingBuffer(torch.device("cpu"))
    assert staging.pack(bucket, bucket_meta(bucket)) == total
    first = staging.flat
    views = unpack(staging.flat, [t.shape for _, t in bucket], [t.dtype for _, t in bucket])
    for (_, t), v in zip(bucket, views):
        assert torch.equal(t, v)
    staging.pack(bucket[:1], bucket_meta(bucket[:1]))  # smaller bucket: the same buffer again
    assert staging.flat.data_ptr() == first.data_ptr()


def _named(spec: list[tuple[str, int]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.zeros(k, dtype=torch.uint8)) for n, k in spec]


def test_expert_weights_get_buckets_of_their_own_sized_by_the_ep_degree() -> None:
    named = _named([("model.embed_tokens.weight", 40),
                    ("model.layers.0.mlp.experts.0.up_proj.weight", 30),
                    ("model.layers.0.mlp.gate.weight", 30),
                    ("model.layers.0.mlp.experts.1.up_proj.weight", 30),
                    ("model.layers.0.mlp.experts.2.up_proj.weight", 30),
                    ("model.norm.weight", 50)])
    out = list(iter_update_buckets(named, 100, expert_parallel_size=1))
    kinds = [{".experts." in n for n, _ in b} for b, _ in out]
    assert all(len(k) == 1 for k in kinds)  # never mixed
    assert [last for _, last in out] == [False] * (len(out) - 1) + [True]
    assert sum(len(b) for b, _ in out) == len(named)
    experts_ep1 = [b for b, _ in out if ".experts." in b[0][0]]
    assert [len(b) for b in experts_ep1] == [3]  # 90 bytes <= 100
    # With EP degree 2 the flushed bucket is twice the accumulated bytes: 3 x 30 x 2 > 100.
    out2 = list(iter_update_buckets(named, 100, expert_parallel_size=2))
    experts_ep2 = [b for b, _ in out2 if ".experts." in b[0][0]]
    assert [len(b) for b in experts_ep2] == [1, 1, 1]
    # A dense model: the expert pass finds nothing.
    dense = _named([("a", 60), ("b", 60)])
    assert [len(b) for b, _ in iter_update_buckets(dense, 100)] == [1, 1]


def test_p2p_transport_refuses_bad_source_settings_and_ipc_without_cuda() -> None:
    from milepost.weights.p2p import P2PTransport

    with pytest.raises(ValueError, match="source_rank 2 must be in"):
        P2PTransport(["http://127.0.0.1:1"], source_rank=2, num_sources=2)
    with pytest.raises(ValueError, match="ipc=True needs backend 'nccl'"):
        P2PTransport(["http://127.0.0.1:1"], "gloo", ipc=True)


def test_local_urls_are_recognized() -> None:
    from milepost.weights.p2p_ipc import is_local_url

    assert is_local_url("http://127.0.0.1:30000") and is_local_url("http://localhost:1")
    assert not is_local_url("http://192.0.2.1:30000")  # TEST-NET-1: never this host
