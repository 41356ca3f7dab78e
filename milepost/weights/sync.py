"""The trainer's weight update: named HF weights -> fixed-size buckets -> a transport -> engines.

Contract with the trainer: `named_hf_weights()` is a collective (each rank gathers shards), so
EVERY trainer rank calls `WeightSync.update` with its own iterator, in step. Rank 0 holds a
transport and sends; the other ranks build `WeightSync(None, ...)` and just iterate, except under
P2P with several sources, where every rank holds a transport for its own engines and only the
coordinating one (rank 0; `transport.coordinates`) runs the checks. If sending fails, a rank
still drains its iterator before raising, so the other ranks' gathers complete instead of
hanging. The first gather also orders rank 0's engine randomization (`check_equal_once`) before
any other source's first bucket. The caller pauses generation around an update if engines must not serve a
mix of old and new buckets (`/pause_generation`, then `/continue_generation`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from milepost.lowprec.engine_scales import is_input_scale
from milepost.weights.bucket import iter_update_buckets, tensor_nbytes
from milepost.weights.transport import WeightTransport
from milepost.weights.verify import (
    compare_digests,
    quantized_names,
    randomize_engines,
    tensor_digest,
    verify,
)

__all__ = ["UpdateStats", "WeightSync", "verify"]


@dataclass(frozen=True)
class UpdateStats:
    """What one update moved (zeros on ranks that only gather)."""

    version: str
    bytes: int
    tensors: int
    buckets: int
    seconds: float
    verified: bool = False  # every engine's checksums matched what was sent
    metrics: dict[str, float] | None = None  # the transport's own numbers (disk-delta: bytes)


class WeightSync:
    """Sends the trainer's weights to the engines, one bucket of `bucket_bytes` at a time.

    transport: the rank-0 transport, or None on the other trainer ranks.
    dtype: cast floating tensors to it before sending (the engine's dtype; the engines refuse
        a dtype other than their own, so a bf16 engine needs bf16 weights from an fp32 trainer).
    check_weight_update: after each update, compare sha256 digests of what was sent with what
        every engine holds (`GET /weights_checksum`); costs a pass over the weights on each side.
    check_equal_once: `--check-weight-update-equal` (report 4.4): before the first update fill
        every engine tensor with noise, and after it require every engine tensor (but names
        matching a `check_skip` glob) to equal, bit for bit, what the trainer sent (a tensor an
        engine stores quantized: within its format's error bound, milepost/weights/fp8.py).
    expert_parallel_size: the expert pass's size multiplier (1 for FSDP).
    scope: a name prefix: the equality check randomizes and requires only the engines' tensors
        under it (a LoRA run: "policy/", its adapter; the frozen base is never sent).
    """

    def __init__(self, transport: WeightTransport | None, bucket_bytes: int,
                 *, dtype: torch.dtype | None = None, check_weight_update: bool = False,
                 check_equal_once: bool = False, check_skip: tuple[str, ...] = (),
                 expert_parallel_size: int = 1, scope: str | None = None) -> None:
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype (the engine's), got {dtype}")
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.check_weight_update = check_weight_update
        self.check_equal_pending = check_equal_once
        self.check_skip = tuple(check_skip)
        self.expert_parallel_size = expert_parallel_size
        self.scope = scope  # LoRA: the update covers the engines' "policy/" tensors, not the base

    @property
    def sends(self) -> bool:
        """True on the rank that sends (rank 0)."""
        return self.transport is not None

    def update(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: str) -> UpdateStats:
        """Move `named_weights` (HF names) to every engine; every engine then reports `version`.

        Call on every trainer rank with that rank's iterator (see the module docstring).
        """
        start = time.perf_counter()
        items = iter(named_weights)
        if self.transport is None:
            for _ in items:  # take part in the gathers; rank 0 sends
                pass
            return UpdateStats(version, 0, 0, 0, time.perf_counter() - start)
        transport = self.transport
        coordinating = getattr(transport, "coordinates", True)  # False: a P2P source rank > 0
        check_equal = self.check_equal_pending and coordinating
        checks = coordinating and (self.check_weight_update or check_equal)
        digests: dict[str, str] | None = {} if checks else None
        values: dict[str, torch.Tensor] = {}  # host copies of what engines store quantized
        n_bytes = n_tensors = n_buckets = 0
        try:
            keep = quantized_names(transport.engine_urls) if checks else set()
            if check_equal:
                randomize_engines(transport.engine_urls, prefix=self.scope)
            transport.begin(version)
            for bucket, last in iter_update_buckets(self._prepared(items, digests, keep, values),
                                                    self.bucket_bytes, self.expert_parallel_size):
                transport.send(bucket, last=last)
                n_buckets += 1
                n_tensors += len(bucket)
                n_bytes += sum(tensor_nbytes(t) for _, t in bucket)
        except BaseException:
            for _ in items:  # let the other ranks' gathers finish before this rank raises
                pass
            raise
        if n_tensors == 0:
            raise ValueError(f"weight update {version!r}: named_weights yielded no tensor on the "
                             "sending rank; pass the trainer's named_hf_weights()")
        transport.finish(version)
        if not coordinating:
            self.check_equal_pending = False  # rank 0's check covers this rank's engines
        verified = False
        if digests is not None:
            compare_digests(digests, transport.engine_urls, require_all=check_equal,
                            skip=self.check_skip if check_equal else (), values=values,
                            scope=self.scope)
            verified = True
            self.check_equal_pending = False
        metrics = transport.metrics() if hasattr(transport, "metrics") else None
        return UpdateStats(version, n_bytes, n_tensors, n_buckets, time.perf_counter() - start,
                           verified, metrics)

    def _prepared(self, items: Iterator[tuple[str, torch.Tensor]],
                  digests: dict[str, str] | None, keep: set[str] = frozenset(),
                  values: dict[str, torch.Tensor] | None = None,
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in items:
            tensor = tensor.detach()
            if (self.dtype is not None and tensor.is_floating_point() and tensor.dtype != self.dtype
                    and not is_input_scale(name)):  # float32 scales: a cast would round them
                tensor = tensor.to(self.dtype)
            if digests is not None:
                digests[name] = tensor_digest(tensor)
            if name in keep:
                values[name] = tensor.to("cpu", copy=True)
            yield name, tensor

    def verify(self, named_weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Check now that every engine holds exactly `named_weights` (cast like `update`)."""
        if self.transport is None:
            raise ValueError("WeightSync.verify runs on the sending rank (the one with a transport)")
        return verify(self._prepared(iter(named_weights), None), self.transport.engine_urls)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
