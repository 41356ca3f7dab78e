"""Cut a stream of named Hugging Face tensors into buckets of a fixed byte size.

Every weight transport moves buckets, never single tensors: one engine call per bucket, and at
most about `bucket_bytes` of gathered weights alive on the sender at once (report section 4:
"prepare buckets once"). Order is preserved, so a receiver may rely on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

Named = list[tuple[str, torch.Tensor]]


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` occupies on the wire (its elements, not its storage)."""
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[Named]:
    """Yield consecutive lists of (name, tensor) whose bytes sum to at most `bucket_bytes`.

    A bucket is closed as soon as the next tensor would overflow it; a tensor bigger than a
    bucket travels alone. Lazy: the input is read only as far as the bucket being built, so
    a generator that gathers weights on demand holds about one bucket at a time.
    """
    for bucket, _ in iter_buckets_marking_last(named, bucket_bytes):
        yield bucket


def iter_buckets_marking_last(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[Named, bool]]:
    """Like `iter_buckets`, yielding (bucket, is_last).

    Knowing that a bucket is the last costs a look-ahead of one tensor (not one bucket), so the
    final engine call can carry the new weight version and the cache flush.
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    items = iter(named)
    bucket: Named = []
    size = 0
    pending = next(items, None)
    while pending is not None:
        name, tensor = pending
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"iter_buckets: {name!r} is a {type(tensor).__name__}, not a tensor")
        n = tensor_nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket, False  # `pending` still follows
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
        pending = next(items, None)
        if size >= bucket_bytes or pending is None:
            yield bucket, pending is None
            bucket, size = [], 0


@dataclass(frozen=True)
class BucketMeta:
    """What a receiver must know before the bytes of a bucket arrive (SGLang's request fields)."""

    names: list[str]
    dtypes: list[str]  # bare torch names: "bfloat16"
    shapes: list[list[int]]
    nbytes: int

    def __len__(self) -> int:
        return len(self.names)


def bucket_meta(bucket: Named) -> BucketMeta:
    """Names, dtypes, shapes and total bytes of `bucket`, in order."""
    return BucketMeta(
        names=[name for name, _ in bucket],
        dtypes=[str(t.dtype).removeprefix("torch.") for _, t in bucket],
        shapes=[list(t.shape) for _, t in bucket],
        nbytes=sum(tensor_nbytes(t) for _, t in bucket),
    )


def is_expert_weight(hf_name: str) -> bool:
    """Routed expert weights (Qwen3-MoE / Mixtral style `...mlp.experts.N...`), not the router."""
    return ".mlp.experts." in hf_name


def iter_update_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, expert_parallel_size: int = 1
) -> Iterator[tuple[Named, bool]]:
    """(bucket, is_last) with routed expert weights in buckets of their own (the expert pass).

    An expert bucket is flushed when its accumulated bytes *times the expert-parallel degree*
    would pass `bucket_bytes`, because the gather at flush time collects every EP rank's experts
    (report 4.1); with degree 1 (FSDP: every rank gathers whole tensors) the threshold is the
    ordinary one. A dense model has no expert weights, so the expert buckets never appear.
    Ordinary and expert buckets are filled side by side from one pass over `named` (whose
    gathers are collectives every rank runs in step), so at most two open buckets plus one
    finished one are held; a tensor bigger than a bucket travels alone.
    """
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if expert_parallel_size < 1:
        raise ValueError(f"expert_parallel_size must be >= 1, got {expert_parallel_size}")

    def flushed() -> Iterator[Named]:
        open_: dict[bool, Named] = {False: [], True: []}
        size = {False: 0, True: 0}
        for name, tensor in named:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"iter_update_buckets: {name!r} is a {type(tensor).__name__}, "
                                "not a tensor")
            expert = is_expert_weight(name)
            scale = expert_parallel_size if expert else 1
            n = tensor_nbytes(tensor)
            if open_[expert] and (size[expert] + n) * scale > bucket_bytes:
                yield open_[expert]
                open_[expert], size[expert] = [], 0
            open_[expert].append((name, tensor))
            size[expert] += n
        for expert in (False, True):
            if open_[expert]:
                yield open_[expert]

    pending: Named | None = None
    for bucket in flushed():
        if pending is not None:
            yield pending, False
        pending = bucket
    if pending is not None:
        yield pending, True
