"""Buckets of named tensors: fixed byte size, order kept, oversize tensors alone, lazy reading;
and WeightSync's rank contract (non-sending ranks drain; a failing send still drains)."""

from __future__ import annotations

import pytest
import torch

from milepost.weights.bucket import bucket_meta, iter_buckets, iter_buckets_marking_last
from milepost.weights.sync import WeightSync
from milepost.weights.verify import tensor_digest


def named(*sizes: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.zeros(n, dtype=dtype)) for i, n in enumerate(sizes)]


def names(buckets: list) -> list[list[str]]:
    return [[n for n, _ in b] for b in buckets]


def test_buckets_fill_to_the_byte_size_in_order() -> None:
    # fp32: 4 bytes per element; a 40-byte bucket takes 10 elements.
    buckets = list(iter_buckets(named(4, 4, 2, 3, 7, 3), 40))
    assert names(buckets) == [["w0", "w1", "w2"], ["w3", "w4"], ["w5"]]
    assert [bucket_meta(b).nbytes for b in buckets] == [40, 40, 12]
    flat = [n for b in buckets for n, _ in b]
    assert flat == [f"w{i}" for i in range(6)]


def test_a_tensor_bigger_than_a_bucket_goes_alone() -> None:
    buckets = list(iter_buckets(named(2, 30, 1, 1, 11), 40))
    assert names(buckets) == [["w0"], ["w1"], ["w2", "w3"], ["w4"]]
    assert all(bucket_meta(b).nbytes <= 40 or len(b) == 1 for b in buckets)


def test_mixed_dtypes_count_their_own_bytes() -> None:
    items = named(10, dtype=torch.bfloat16) + named(5, dtype=torch.float32)
    items = [(f"{n}_{i}", t) for i, (n, t) in enumerate(items)]
    buckets = list(iter_buckets(items, 40))  # 20 + 20 bytes: one bucket
    assert len(buckets) == 1 and bucket_meta(buckets[0]).nbytes == 40


def test_last_marking_and_empty_input() -> None:
    marks = [last for _, last in iter_buckets_marking_last(named(5, 5, 5), 40)]
    assert marks == [False, True]
    marks = [last for _, last in iter_buckets_marking_last(named(10, 10), 40)]  # full, then full
    assert marks == [False, True]
    assert list(iter_buckets([], 40)) == []


def test_reading_is_lazy_one_tensor_ahead() -> None:
    pulled: list[str] = []

    def gen():
        for name, t in named(10, 10, 10, 10):
            pulled.append(name)
            yield name, t

    it = iter_buckets(gen(), 40)
    first = next(it)
    assert names([first]) == [["w0"]] and pulled == ["w0", "w1"]  # look-ahead of one tensor


def test_bucket_meta() -> None:
    meta = bucket_meta([("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(()))])
    assert meta.names == ["a", "b"] and meta.dtypes == ["bfloat16", "float32"]
    assert meta.shapes == [[2, 3], []] and meta.nbytes == 16 and len(meta) == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_bucket_size_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(named(1), bad))


class RecordingTransport:
    def __init__(self, fail_at: int | None = None) -> None:
        self.engine_urls: list[str] = []
        self.calls: list[tuple] = []
        self.fail_at = fail_at

    def begin(self, version: str) -> None:
        self.calls.append(("begin", version))

    def send(self, bucket, last: bool = False) -> None:
        if self.fail_at is not None and len(self.calls) - 1 == self.fail_at:
            raise RuntimeError("engine 1 (http://x) died")
        self.calls.append(("send", [n for n, _ in bucket], last))

    def finish(self, version: str) -> None:
        self.calls.append(("finish", version))

    def close(self) -> None:
        pass


def counting(items, seen: list[str]):
    for name, t in items:
        seen.append(name)
        yield name, t


def test_sync_sends_buckets_marks_the_last_and_casts() -> None:
    transport = RecordingTransport()
    sync = WeightSync(transport, 40, dtype=torch.bfloat16)
    stats = sync.update(named(10, 10, 10, 3) + [("ids", torch.zeros(1, dtype=torch.int64))], "v1")
    # cast to bf16 first: 20 bytes each, so two per bucket; int64 stays int64 (8 bytes).
    assert transport.calls == [("begin", "v1"), ("send", ["w0", "w1"], False),
                               ("send", ["w2", "w3", "ids"], True), ("finish", "v1")]
    assert (stats.buckets, stats.tensors, stats.bytes) == (2, 5, 20 + 20 + 20 + 6 + 8)


def test_non_sending_ranks_drain_and_a_failed_send_still_drains() -> None:
    seen: list[str] = []
    stats = WeightSync(None, 40).update(counting(named(10, 10, 10), seen), "v")
    assert seen == ["w0", "w1", "w2"] and stats.buckets == 0

    seen.clear()
    sync = WeightSync(RecordingTransport(fail_at=0), 40)
    with pytest.raises(RuntimeError, match="engine 1"):
        sync.update(counting(named(10, 10, 10, 10), seen), "v")
    assert seen == ["w0", "w1", "w2", "w3"]  # every gather ran although sending stopped


def test_tensor_digest_sees_dtype_shape_and_bits() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t) == tensor_digest(t.t().contiguous().t())  # layout does not matter
    assert tensor_digest(t) != tensor_digest(t.reshape(3, 2))
    assert tensor_digest(t) != tensor_digest(t.to(torch.float64))
    u = t.clone()
    u[1, 2] = torch.nextafter(u[1, 2], torch.tensor(100.0))
    assert tensor_digest(t) != tensor_digest(u)
    assert tensor_digest(torch.zeros(0, 3)) != tensor_digest(torch.zeros(3, 0))
    assert len(tensor_digest(torch.tensor(1.0, dtype=torch.bfloat16))) == 64
