"""Transports: how one bucket of named tensors reaches every engine (report section 4).

Each transport speaks SGLang's HTTP protocol to its engines, once per bucket and to all engines
concurrently; the last bucket carries the new `weight_version` and the cache flush, and `finish`
checks that every engine reports that version. Two kinds for now:

- `BroadcastTransport` (disaggregated): one torch.distributed group, trainer = rank 0, engine i =
  rank 1 + i; each bucket is announced by `/update_weights_from_distributed` and broadcast.
- `TensorTransport` (colocated, same host): each bucket is serialized (CPU tensors by value, CUDA
  tensors by IPC handle) and posted to `/update_weights_from_tensor`.

Every wait is bounded by `timeout_s`; a failure names the engine and leaves the transport broken
(later calls refuse; close it and build a new one), because an engine may hold a partial update.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, Protocol, TypeVar, runtime_checkable

import httpx
import torch

from milepost.auth import client_headers
from milepost.http_tls import tls_context
from milepost.launch.process import free_port
from milepost.weights.bucket import Named, bucket_meta
from milepost.weights.codec import serialize_named_tensors
from milepost.weights.process_group import BackendName, WeightGroup, init_weight_group
from milepost.weights.sender import broadcast_named_tensors

T = TypeVar("T")
_GRACE_S = 2.0  # after a first failure, how long the other calls may take to report theirs


class TransportError(RuntimeError):
    """A weight transfer failed; the message names each engine at fault and what it said."""


@runtime_checkable
class WeightTransport(Protocol):
    """Moves buckets to engines. Call order per update: begin, send..., finish; close at the end."""

    engine_urls: list[str]

    def begin(self, version: str) -> None:
        """Start an update that will end as `version` (set up connections on first use)."""

    def send(self, bucket: Named, last: bool = False) -> None:
        """Deliver one bucket to every engine; `last` marks the bucket that carries the version."""

    def finish(self, version: str) -> None:
        """Make every engine report `version`; raise TransportError naming any that does not."""

    def close(self) -> None:
        """Release connections and groups. Idempotent."""


class _EngineFanout:
    """The HTTP half every transport shares: concurrent calls to all engines, bounded waits."""

    def __init__(self, engine_urls: Sequence[str], timeout_s: float) -> None:
        urls = [str(u).rstrip("/") for u in engine_urls]
        if not urls:
            raise ValueError("a weight transport needs at least one engine URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"engine URLs must be distinct, got {urls}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.engine_urls = urls
        self.timeout_s = float(timeout_s)
        self.version: str | None = None
        self._version_sent = False
        self._broken: str | None = None
        self._closed = False
        self._http = httpx.Client(timeout=self.timeout_s, headers=client_headers(), verify=tls_context(),
                                  limits=httpx.Limits(max_connections=2 * len(urls) + 4))
        self._pool = futures.ThreadPoolExecutor(len(urls), thread_name_prefix="weight-http")

    # -- life cycle shared by both transports ------------------------------------------------

    def begin(self, version: str) -> None:
        self._check_usable()
        if not isinstance(version, str) or not version:
            raise ValueError(f"weight version must be a non-empty string, got {version!r}")
        self.version = version
        self._version_sent = False

    def finish(self, version: str) -> None:
        self._check_usable()
        if version != self.version:
            raise ValueError(f"finish({version!r}) does not match begin({self.version!r})")
        if not self._version_sent:  # no bucket was marked last: set it explicitly
            self._guard(lambda: self._wait(self._post_all(
                "/update_weight_version", lambda i: {"new_version": version})))
        answers = self._guard(lambda: self._wait(self._call_all("GET", "/get_weight_version")))
        wrong = [f"engine {i} ({url}) reports weight_version {a.get('weight_version')!r}"
                 for i, (url, a) in enumerate(zip(self.engine_urls, answers))
                 if a.get("weight_version") != version]
        if wrong:
            self._break("after the update " + "; ".join(wrong) + f", expected {version!r}")

    def _leave_group(self, idle: bool, indices: Sequence[int] | None = None) -> None:
        """Engines (`indices`, default all) leave `self._group` (a group transport's); our side
        closes when `idle`."""
        group, self._group = self._group, None
        if group is None:
            return
        # After a failed send an engine may still sit in a receive on this group; leaving
        # the group under it could hang that engine: it is left to end with its peers.
        if self._broken is None:
            for f in self._post_all("/destroy_weights_update_group",
                                    lambda i: {"group_name": self.group_name}, indices):
                try:
                    f.result()
                except TransportError:
                    pass  # a dead engine: nothing to leave there
        # Closing our side under a running collective is unsafe; one stuck on a dead peer
        # ends at the group's timeout and the group is dropped with it.
        if idle:
            group.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Not waiting: a call to a hung engine ends by itself within timeout_s.
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportError(f"{type(self).__name__} is closed")
        if self._broken is not None:
            raise TransportError(
                f"{type(self).__name__} is unusable after an earlier failure ({self._broken}); "
                "engines may hold a partial update: close it, fix the engine, build a new one "
                "and send the full weights again"
            )

    def _break(self, message: str) -> None:
        self._broken = message
        raise TransportError(message)

    def _guard(self, fn: Callable[[], T]) -> T:
        """Run fn; a TransportError from it breaks the transport."""
        try:
            return fn()
        except TransportError as e:
            self._broken = str(e)
            raise

    def _call(self, i: int, method: str, path: str, body: dict | None) -> dict:
        url = self.engine_urls[i]
        who = f"engine {i} ({url})"
        try:
            r = self._http.request(method, url + path, json=body)
        except httpx.TimeoutException as e:
            raise TransportError(f"{who}: {path} did not answer within {self.timeout_s:g}s "
                                 f"({type(e).__name__})") from e
        except httpx.HTTPError as e:
            raise TransportError(f"{who}: {path} failed ({type(e).__name__}: {e}); "
                                 "is the engine running?") from e
        try:
            answer = r.json()
        except ValueError:
            answer = {"message": r.text}
        if not isinstance(answer, dict):
            answer = {"message": r.text}
        if r.status_code != 200 or answer.get("success") is False:
            message = answer.get("message") or answer.get("error") or r.text
            raise TransportError(f"{who}: {path} answered {r.status_code}: {message}")
        return answer

    def _call_all(self, method: str, path: str, body_for: Callable[[int], dict] | None = None,
                  indices: Sequence[int] | None = None) -> list[futures.Future]:
        """One call per engine in `indices` (default: every engine), in that order."""
        chosen = range(len(self.engine_urls)) if indices is None else indices
        return [self._pool.submit(self._call, i, method, path, body_for(i) if body_for else None)
                for i in chosen]

    def _post_all(self, path: str, body_for: Callable[[int], dict],
                  indices: Sequence[int] | None = None) -> list[futures.Future]:
        return self._call_all("POST", path, body_for, indices)

    def _wait(self, pending: list[futures.Future], also: Sequence[futures.Future] = (),
              indices: Sequence[int] | None = None) -> list[Any]:
        """Results of `pending` (one per engine of `indices`, default all), waiting also for
        `also` (local work).

        Returns at the first failure, without waiting for the rest (a peer that failed may
        leave the others blocked until their own timeouts); raises TransportError listing
        every failure known by then, or naming what did not finish within timeout_s.
        """
        who = list(range(len(pending))) if indices is None else list(indices)
        everything = [*pending, *also]
        done, not_done = futures.wait(everything, timeout=self.timeout_s + 5,
                                      return_when=futures.FIRST_EXCEPTION)
        if any(f.exception() for f in done) and not_done:
            # A lost peer often shows first as the trainer's collective failing, which cannot
            # say which engine it was; its HTTP call names it a moment later.
            done, not_done = futures.wait(everything, timeout=min(_GRACE_S, self.timeout_s))
        errors = [str(f.exception()) for f in everything if f in done and f.exception()]
        if errors:
            waiting = [f"engine {i} ({self.engine_urls[i]})" for i, f in zip(who, pending)
                       if f in not_done]
            if waiting:
                errors.append(f"still waiting on {', '.join(waiting)}")
            raise TransportError("; ".join(errors))
        if not_done:
            late = [f"engine {i} ({self.engine_urls[i]})" for i, f in zip(who, pending)
                    if f in not_done]
            late += ["the trainer's side" for f in also if f in not_done]
            raise TransportError(f"no answer within {self.timeout_s:g}s from {', '.join(late)}")
        return [f.result() for f in pending]

    def _last_fields(self, last: bool) -> dict:
        if last:
            self._version_sent = True
        return {"flush_cache": last, "weight_version": self.version if last else None}


def _in_daemon_thread(fn: Callable[[], T], name: str) -> futures.Future[T]:
    """Run fn in a daemon thread: a collective stuck on a dead peer must not block exit."""
    fut: futures.Future[T] = futures.Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class BroadcastTransport(_EngineFanout):
    """Disaggregated engines: one weight group, trainer rank 0, engine i rank 1 + i.

    Each engine is tensor-parallel 1 (its rank_offset is 1 + i; world size 1 + n engines). The
    group is created on the first `begin`, with a group name unique to this transport so leftovers
    on an engine never collide. With backend "nccl" the trainer's tensors go from the CUDA device
    current when the transport was built.
    """

    def __init__(self, engine_urls: Sequence[str], backend: BackendName = "gloo",
                 master_address: str = "127.0.0.1", master_port: int | None = None,
                 group_name: str | None = None, timeout_s: float = 300.0) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        super().__init__(engine_urls, timeout_s)
        self.backend: BackendName = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name or f"milepost_weights_{uuid.uuid4().hex[:8]}"
        self._device = torch.cuda.current_device() if backend == "nccl" else None
        self._group: WeightGroup | None = None
        self._inflight: futures.Future | None = None  # a broadcast that may still be running

    def begin(self, version: str) -> None:
        super().begin(version)
        if self._group is None:
            self._group = self._guard(self._init_group)

    def _init_group(self) -> WeightGroup:
        # Check every engine answers first: once rank 0 hosts the store it waits for all
        # members for timeout_s, in a thread nothing can stop.
        try:
            self._wait(self._call_all("GET", "/health"))
        except TransportError as e:
            raise TransportError(f"creating weight group {self.group_name!r}: {e}") from e
        port = self.master_port or free_port(self.master_address)
        world = 1 + len(self.engine_urls)
        posts = self._post_all("/init_weights_update_group", lambda i: {
            "master_address": self.master_address, "master_port": port, "rank_offset": 1 + i,
            "world_size": world, "group_name": self.group_name, "backend": self.backend})

        def join() -> WeightGroup:
            self._use_device()
            return init_weight_group(self.master_address, port, 0, world, self.group_name,
                                     self.backend, timeout_s=self.timeout_s)

        joined = _in_daemon_thread(join, "weight-group-init")
        try:
            self._wait(posts, also=[joined])
        except TransportError as e:
            # A group that still forms later belongs to nobody: close it then.
            joined.add_done_callback(lambda f: f.exception() or f.result().close())
            raise TransportError(f"creating weight group {self.group_name!r} failed: {e}") from e
        return joined.result()

    def send(self, bucket: Named, last: bool = False) -> None:
        self._check_usable()
        if self._group is None or self.version is None:
            raise TransportError("BroadcastTransport.send before begin(version)")
        if not bucket:
            raise ValueError("BroadcastTransport.send: empty bucket")
        group = self._group
        meta = bucket_meta(bucket)
        body = {"names": meta.names, "dtypes": meta.dtypes, "shapes": meta.shapes,
                "group_name": self.group_name, **self._last_fields(last)}
        if self.backend == "nccl":  # the broadcast runs on another thread's stream
            torch.cuda.current_stream().synchronize()
        posts = self._post_all("/update_weights_from_distributed", lambda i: body)

        def broadcast() -> None:
            self._use_device()
            try:
                broadcast_named_tensors(group, bucket)
            except Exception as e:  # torch raises several types for a lost peer
                raise TransportError(f"the trainer's broadcast over {self.group_name!r} failed "
                                     f"({type(e).__name__}: {e})") from e
            if self.backend == "nccl":
                torch.cuda.synchronize()

        self._inflight = _in_daemon_thread(broadcast, "weight-broadcast")
        self._guard(lambda: self._wait(posts, also=[self._inflight]))

    def _use_device(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)

    def close(self) -> None:
        """Leave the group on every engine that answers, then close the trainer's side."""
        if not self._closed:
            self._leave_group(self._inflight is None or self._inflight.done())
        super().close()


class TensorTransport(_EngineFanout):
    """Colocated engines on this host: buckets go through `/update_weights_from_tensor`.

    CPU tensors travel by value inside the request; CUDA tensors as IPC handles, which the engine
    opens in place (so it must run on the same host, on a device that can read the tensor's).
    The bucket stays referenced until every engine answered, keeping IPC'd memory alive.
    """

    def __init__(self, engine_urls: Sequence[str], timeout_s: float = 300.0) -> None:
        super().__init__(engine_urls, timeout_s)

    def send(self, bucket: Named, last: bool = False) -> None:
        self._check_usable()
        if self.version is None:
            raise TransportError("TensorTransport.send before begin(version)")
        if not bucket:
            raise ValueError("TensorTransport.send: empty bucket")
        for device in {t.device for _, t in bucket if t.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the engine reads the memory directly
        body = {"serialized_named_tensors": [serialize_named_tensors(bucket)],
                **self._last_fields(last)}
        # `bucket` (the caller's, and ours) outlives this wait: the IPC'd storages stay alive.
        self._guard(lambda: self._wait(self._post_all("/update_weights_from_tensor", lambda i: body)))
