"""The bounded buffer between the rollout worker and the trainer (report section 2.2.2).

Operations: `put` a finished group (blocks while full), `take` a batch (blocks until enough
fresh groups wait), `metrics` (report table 2). Drops follow report table 1: a group generation
gave up on, or one the user filter rejects, is checked on arrival; staleness is checked when the
trainer takes the group, because a group keeps aging while it waits. Each drop goes to a
`DropSink`, which retries (requeues) the prompt or discards it. Deviation: besides the report's
three operations, a buffer has `close()` (wakes blocked callers at shutdown) and `len()` (groups
waiting now, for the run's prompt accounting). A user's class replaces `GroupBuffer` by import
path (`--buffer-class`) and is checked at start by `check_buffer_class`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from milepost.types import Group, Sample, Status

Policy = Literal["retry", "discard"]
DropReason = Literal["aborted", "filtered", "stale", "failed"]
# The report's table 2 names (the driver adds the rollout/fully_async/ prefix).
REQUIRED_METRICS = ("queue_size", "avg_staleness", "max_staleness", "buffer_avg_staleness",
                    "buffer_max_staleness", "aborted_groups_filtered", "stale_groups_filtered")


class BufferClosed(RuntimeError):
    """put/take were woken by close(): the run is stopping."""


class DropSink(Protocol):
    def __call__(self, group: Group, reason: DropReason, retry: bool) -> None:
        """Record a dropped group; requeue its prompt when `retry`."""


@dataclass(frozen=True)
class BufferSettings:
    """capacity: groups the buffer holds (factor * train batch). max_staleness: None = no limit.
    group_filter: fn(group) -> bool, False = discard on arrival (always, never retried)."""

    capacity: int
    max_staleness: int | None = None
    stale_policy: Policy = "retry"
    aborted_policy: Policy = "retry"
    group_filter: Callable[[Group], bool] | None = None

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 group, got {self.capacity}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")


@runtime_checkable
class Buffer(Protocol):
    """What the fully-async driver needs from a buffer; constructed as cls(settings, drop)."""

    def put(self, group: Group) -> None: ...

    def take(self, batch_size: int, trainer_version: int) -> list[Group]: ...

    def metrics(self, trainer_version: int) -> dict[str, float]: ...

    def close(self) -> None: ...

    def __len__(self) -> int: ...


def oldest_version(group: Group) -> int | None:
    """The oldest weight version of any response token in the group (None: no token at all)."""
    versions = [v for s in group for v in s.weight_versions]
    if not versions:
        return None
    try:
        return min(int(v) for v in versions)
    except ValueError:
        raise ValueError(
            f"weight versions {sorted(set(versions))[:4]} are not integers; fully async training "
            "measures staleness in integer versions (milepost starts engines at '0'; start "
            "external engines with --weight-version 0)") from None


def staleness(group: Group, trainer_version: int) -> int:
    """Trainer version minus the oldest token version (pessimistic, report 2.2.2); a group with
    no response token carries no version and counts as fresh."""
    oldest = oldest_version(group)
    return 0 if oldest is None else trainer_version - oldest


def generation_gave_up(group: Group) -> bool:
    return any(s.status is Status.ABORTED for s in group)


class GroupBuffer:
    """FIFO of finished groups, bounded by `settings.capacity`; thread-safe (the rollout worker
    puts from its thread, the trainer takes from the main thread)."""

    def __init__(self, settings: BufferSettings, drop: DropSink) -> None:
        self.settings = settings
        self.drop = drop
        self._groups: deque[Group] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._last_taken: list[int] = []  # staleness of the last batch taken
        self._queue_size_at_take = 0
        self._counts = {"aborted": 0, "stale": 0, "filtered": 0}  # since the last metrics()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def put(self, group: Group) -> None:
        """Arrival checks (gave up -> policy; filter -> discard), then wait for room."""
        if generation_gave_up(group):
            self._count("aborted")
            self.drop(group, "aborted", self.settings.aborted_policy == "retry")
            return
        keep = self.settings.group_filter
        if keep is not None and not keep(group):
            self._count("filtered")
            self.drop(group, "filtered", False)  # no advantage signal: retrying cannot help
            return
        with self._cond:
            while len(self._groups) >= self.settings.capacity and not self._closed:
                self._cond.wait()
            if self._closed:
                raise BufferClosed("the buffer was closed while a group waited for room")
            self._groups.append(group)
            self._cond.notify_all()

    def take(self, batch_size: int, trainer_version: int) -> list[Group]:
        """The `batch_size` oldest groups within the staleness limit; stale ones met on the way
        are dropped (retried or discarded per policy)."""
        if batch_size > self.settings.capacity:
            raise ValueError(f"take({batch_size}) can never be served by a buffer of "
                             f"{self.settings.capacity} groups")
        limit = self.settings.max_staleness
        taken: list[Group] = []
        with self._cond:
            # queue_size: what waited when the step came to collect (report table 2).
            self._queue_size_at_take = len(self._groups)
            while len(taken) < batch_size:
                while not self._groups and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise BufferClosed("the buffer was closed while the trainer waited for a batch")
                group = self._groups.popleft()
                self._cond.notify_all()  # room for a blocked put
                if limit is not None and staleness(group, trainer_version) > limit:
                    self._counts["stale"] += 1
                    self.drop(group, "stale", self.settings.stale_policy == "retry")
                    continue
                taken.append(group)
        self._last_taken = [staleness(g, trainer_version) for g in taken]
        return taken

    def metrics(self, trainer_version: int) -> dict[str, float]:
        with self._cond:
            waiting = [staleness(g, trainer_version) for g in self._groups]
            counts, self._counts = self._counts, {k: 0 for k in self._counts}
        drawn = self._last_taken
        return {
            "queue_size": float(self._queue_size_at_take),
            "avg_staleness": sum(drawn) / len(drawn) if drawn else 0.0,
            "max_staleness": float(max(drawn, default=0)),
            "buffer_avg_staleness": sum(waiting) / len(waiting) if waiting else 0.0,
            "buffer_max_staleness": float(max(waiting, default=0)),
            "aborted_groups_filtered": float(counts["aborted"]),
            "stale_groups_filtered": float(counts["stale"]),
            "filter_groups_filtered": float(counts["filtered"]),
        }

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _count(self, key: str) -> None:
        with self._cond:
            self._counts[key] += 1


# ---- the contract a user's buffer class must meet, checked at start ----------------------------

def _probe_group(index: int) -> Group:
    return [Sample(group_index=index, index=k, tokens=[1, 2, 3], response_length=1,
                   loss_mask=[1], rollout_logprobs=[-0.5], weight_versions=["0"], reward=float(k))
            for k in range(2)]


def check_buffer_class(cls: Any, name: str, timeout_s: float = 5.0) -> None:
    """Refuse a buffer class that does not behave as the driver needs (ValueError naming `name`).

    Builds one with capacity 2 and a recording sink, puts two fresh groups, takes them back
    (same objects, in a thread so a take that never returns is caught), reads the metrics.
    """
    def fail(why: str) -> None:
        raise ValueError(f"--buffer-class {name} violates the buffer contract: {why} (see "
                         "milepost/data/buffer.py: cls(settings, drop) with put, take, metrics, "
                         "close, __len__)")

    missing = [m for m in ("put", "take", "metrics", "close", "__len__")
               if not callable(getattr(cls, m, None))]
    if missing:
        fail(f"it has no {', '.join(missing)}")
    drops: list[tuple[int, str]] = []
    try:
        buf = cls(BufferSettings(capacity=2), lambda g, reason, retry: drops.append((id(g), reason)))
    except Exception as e:  # noqa: BLE001 - any failure of user code is the contract's failure
        fail(f"cls(settings, drop) raised {type(e).__name__}: {e}")
    groups = [_probe_group(0), _probe_group(1)]
    result: dict[str, Any] = {}

    def exercise() -> None:
        try:
            for g in groups:
                buf.put(g)
            result["len"] = len(buf)
            result["taken"] = buf.take(2, 0)
            result["metrics"] = buf.metrics(0)
            buf.close()
        except Exception as e:  # noqa: BLE001
            result["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=exercise, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        fail(f"put 2 groups into capacity 2, then take(2) did not return within {timeout_s:g} s")
    if "error" in result:
        fail(f"it raised {result['error']}")
    if result["len"] != 2:
        fail(f"len() was {result['len']} after putting 2 groups")
    taken = result["taken"]
    if not isinstance(taken, list) or sorted(map(id, taken)) != sorted(map(id, groups)):
        fail("take(2) did not return the 2 fresh groups that were put")
    metrics = result["metrics"]
    if not isinstance(metrics, dict) or any(k not in metrics for k in REQUIRED_METRICS):
        fail(f"metrics() must return a dict with {', '.join(REQUIRED_METRICS)}")
    if not all(isinstance(v, (int, float)) for v in metrics.values()):
        fail("metrics() values must be numbers")
    if drops:
        fail(f"it dropped fresh, complete groups ({drops[0][1]})")
