"""The disk-delta transport (report 4.3): buckets become a version in a shared store, then every
engine pulls, patches and checks it, and only when all succeeded does any engine reload.

Per update: `send` feeds each bucket's tensors to the DeltaWriter (nothing is sent to engines per
bucket); `finish` publishes the version (index last), asks every engine to prepare it (pull,
patch its host copy, check per-tensor digests: `/weights_delta/prepare`), and only if all
prepared it, pauses generation (the configured mode), commits (reload into the model) and resumes.
A refusal anywhere discards the prepared state everywhere: no engine reloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from milepost.weights.bucket import Named
from milepost.weights.disk_delta import DeltaIndex, DeltaWriter, Encoding
from milepost.weights.transport import TransportError, _EngineFanout

PAUSE_MODES = ("retract", "in_place", "abort")


class DiskDeltaTransport(_EngineFanout):
    """Trainer side of disk-delta; `root` must be visible to every engine host at the same path."""

    def __init__(self, engine_urls: Sequence[str], root: Path, encoding: Encoding = "xor",
                 pause_mode: str | None = "retract", timeout_s: float = 300.0) -> None:
        if pause_mode is not None and pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES} or None, got {pause_mode!r}")
        super().__init__(engine_urls, timeout_s)
        self.root = Path(root).absolute()
        self.writer = DeltaWriter(self.root, encoding)
        self.pause_mode = pause_mode
        self.last_index: DeltaIndex | None = None

    def begin(self, version: str) -> None:
        super().begin(version)
        if self.writer.has_open_version:  # a failed update left a version open: never publish it
            self.writer.abort()
        self.writer.begin(version)

    def send(self, bucket: Named, last: bool = False) -> None:
        self._check_usable()
        for name, tensor in bucket:
            self.writer.add(name, tensor)

    def finish(self, version: str) -> None:
        self._check_usable()
        index = self.writer.commit()
        self.last_index = index
        self._version_sent = True
        prepare = {"root": str(self.root), "version": index.version}
        try:
            self._wait(self._post_all("/weights_delta/prepare", lambda i: prepare))
        except TransportError as e:
            self._discard_all()
            self.writer.version = None  # the next version is full, so engines resynchronize
            # Not broken: every engine still serves its old weights and its copy is unchanged.
            raise TransportError(f"delta version {index.version} refused, no engine reloaded: {e}"
                                 ) from e
        if self.pause_mode is not None:
            self._guard(lambda: self._wait(self._post_all(
                "/pause_generation", lambda i: {"mode": self.pause_mode})))
        try:
            self._guard(lambda: self._wait(self._post_all("/weights_delta/commit", lambda i: {
                "version": index.version, "weight_version": version, "flush_cache": True})))
        finally:
            if self.pause_mode is not None:
                self._wait(self._post_all("/continue_generation", lambda i: {}))
        super().finish(version)

    def _discard_all(self) -> None:
        for f in self._post_all("/weights_delta/discard", lambda i: {}):
            try:
                f.result()
            except TransportError:
                pass

    def metrics(self) -> dict[str, float]:
        """The last update's delta numbers (empty before the first)."""
        i = self.last_index
        if i is None:
            return {}
        return {"perf/update_weights_delta_changed_fraction": i.bytes_changed / max(i.bytes_total, 1),
                "perf/update_weights_delta_bytes_written": float(i.bytes_written),
                "perf/update_weights_delta_version": float(i.version)}
