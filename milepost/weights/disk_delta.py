"""Disk-delta weight versions (report 4.3): the on-disk format, its writer and its reader.

A store is a directory both sides can see. Version 0 (or any version with encoding "full") holds
every tensor; each later version holds only the tensors that changed since the version before it
(its declared base), zstd-compressed, in one data file, plus `index.json` (version, base version,
encoding, digest algorithm, per-tensor digests of the *resulting* state). Every file is written
atomically (temp file, fsync, rename) and the index last, so a version without an index is a
partial one that no reader ever sees.

Encodings: "xor" (default) stores new ^ base bytes; applying it twice restores the old bytes,
so a reader applies it only on top of exactly its declared base. "overwrite" stores the changed
element positions and their new values: idempotent. Both work on raw bytes, so base and policy
must agree on names, dtypes and shapes (checked). Deviation: each version's base is the version
before it (a chain), not the first snapshot; the writer starts a new "full" version after a restart.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

import pydantic
import torch
import xxhash
import zstandard
from pydantic import NonNegativeInt

Encoding = Literal["xor", "overwrite"]
ENCODINGS = ("xor", "overwrite")
INDEX_NAME = "index.json"
DATA_NAME = "tensors.zst"
DIGEST_ALGORITHM = "xxh3_64"
FORMAT = 1
_VERSION_DIR = re.compile(r"^v(\d{8})$")
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta version cannot be written or applied; the message names the version and the fix."""


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-64 hex of a tensor's dtype, shape and element bytes."""
    h = xxhash.xxh3_64(f"{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
    if t.numel():
        h.update(memoryview(as_bytes(t).numpy()))
    return h.hexdigest()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The element bytes of `t` as a flat uint8 CPU tensor (a view when already compact on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous().reshape(-1).view(torch.uint8)


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:08d}"


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees either nothing or all of it."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class TensorEntry:
    dtype: str
    shape: list[NonNegativeInt]
    offset: NonNegativeInt  # of its compressed frame in the data file
    length: NonNegativeInt
    changed: NonNegativeInt = 0  # overwrite: changed elements; xor/full: unused


@dataclass
class DeltaIndex:
    version: NonNegativeInt
    base_version: NonNegativeInt | None  # None: a full version, applies on any state
    encoding: str  # "full" | "xor" | "overwrite"
    weight_version: str  # what engines report once it is loaded
    digest_algorithm: str = DIGEST_ALGORITHM
    compression: str = "zstd"
    format: int = FORMAT
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # every tensor of the resulting state
    bytes_total: int = 0
    bytes_changed: int = 0
    bytes_written: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: Path) -> DeltaIndex:
        # Strict schema: a field of the wrong type ("offset": "0", "tensors": []) is refused
        # here with its path, never met later as a TypeError mid-apply.
        try:
            index = _INDEX_SCHEMA.validate_json(raw, strict=True)
        except pydantic.ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'index'}: {err['msg']}"
                                 for err in e.errors()[:5])
            raise DeltaError(f"{where} is not a valid delta index ({problems})") from e
        if index.format != FORMAT or index.digest_algorithm != DIGEST_ALGORITHM:
            raise DeltaError(f"{where}: format {index.format} / digest {index.digest_algorithm} is "
                             f"not this reader's ({FORMAT} / {DIGEST_ALGORITHM})")
        if index.encoding not in ("full", *ENCODINGS):
            raise DeltaError(f"{where}: unknown encoding {index.encoding!r}")
        return index


_INDEX_SCHEMA = pydantic.TypeAdapter(DeltaIndex)


def published_versions(root: Path) -> list[int]:
    """Versions whose index is in place (complete), ascending; partial directories are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _VERSION_DIR.match(p.name)
        if m and (p / INDEX_NAME).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def read_index(root: Path, version: int) -> DeltaIndex:
    path = version_dir(root, version) / INDEX_NAME
    if not path.is_file():
        raise DeltaError(f"delta version {version} is not published under {root} (no {INDEX_NAME}: "
                         "missing, or a write that never finished); the trainer must publish it")
    index = DeltaIndex.from_json(path.read_bytes(), path)
    if index.version != version:
        raise DeltaError(f"{path} says version {index.version}, its directory says {version}")
    return index


class DeltaWriter:
    """The trainer's side: keeps a host snapshot of the last published state, writes versions.

    Per version: `begin`, `add` every tensor (any order, each once), `commit` (data file, then the
    index). The first version after construction is "full" and becomes the base.
    """

    def __init__(self, root: Path, encoding: Encoding = "xor", level: int = 3) -> None:
        if encoding not in ENCODINGS:
            raise DeltaError(f"delta encoding must be one of {ENCODINGS}, got {encoding!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.encoding = encoding
        self._cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
        self.snapshot: dict[str, torch.Tensor] = {}  # name -> dtype/shape-typed CPU copy
        self.version: int | None = None  # the last committed version
        self._next: DeltaIndex | None = None
        self._pending: dict[str, torch.Tensor] = {}
        self._data: BinaryIO | None = None
        self._data_tmp: Path | None = None
        self._pos = 0

    @property
    def has_open_version(self) -> bool:
        return self._next is not None

    def begin(self, weight_version: str) -> int:
        """Start the next version; returns its number."""
        if self._next is not None:
            raise DeltaError("DeltaWriter.begin while a version is open; commit or abort it first")
        done = published_versions(self.root)
        number = (max(done) + 1) if done else 0
        full = self.version is None
        index = DeltaIndex(number, None if full else self.version,
                           "full" if full else self.encoding, weight_version)
        vdir = version_dir(self.root, number)
        if vdir.exists():  # a partial version left by a killed writer: never published, redo it
            for p in vdir.iterdir():
                p.unlink()
        vdir.mkdir(parents=True, exist_ok=True)
        self._data_tmp = vdir / f".{DATA_NAME}.{uuid.uuid4().hex[:8]}.tmp"
        self._data = open(self._data_tmp, "wb")
        self._pos = 0
        self._next, self._pending = index, {}
        return number

    def add(self, name: str, tensor: torch.Tensor) -> None:
        index = self._next
        if index is None:
            raise DeltaError("DeltaWriter.add before begin")
        if name in self._pending:
            raise DeltaError(f"{name}: added twice to delta version {index.version}")
        new = tensor.detach().to("cpu").contiguous().clone()
        new_bytes = as_bytes(new)
        index.bytes_total += new_bytes.numel()
        index.digests[name] = tensor_digest(new)
        self._pending[name] = new
        if index.encoding == "full":
            self._frame(name, new, new_bytes.numpy().tobytes(), 0)
            index.bytes_changed += new_bytes.numel()
            return
        old = self.snapshot.get(name)
        if old is None or old.dtype != new.dtype or old.shape != new.shape:
            was = "absent" if old is None else f"{old.dtype} {list(old.shape)}"
            raise DeltaError(f"{name}: base version {self.version} holds it as {was}, now "
                             f"{new.dtype} {list(new.shape)}; a delta needs the same names, dtypes "
                             "and shapes as its base (restart the run to publish a new base)")
        diff = torch.bitwise_xor(as_bytes(old), new_bytes)
        changed_bytes = int(torch.count_nonzero(diff))
        if changed_bytes == 0:
            return
        index.bytes_changed += changed_bytes
        if index.encoding == "xor":
            self._frame(name, new, diff.numpy().tobytes(), 0)
        else:
            ints = _INT_OF_SIZE[new.element_size()]
            new_el, old_el = new.reshape(-1).view(ints), old.reshape(-1).view(ints)
            pos = torch.nonzero(new_el != old_el).reshape(-1)
            pos = pos.to(torch.int32) if new_el.numel() < 2**31 else pos
            payload = pos.numpy().tobytes() + new_el[pos.long()].numpy().tobytes()
            self._frame(name, new, payload, int(pos.numel()))

    def _frame(self, name: str, t: torch.Tensor, payload: bytes, changed: int) -> None:
        blob = self._cctx.compress(payload)
        self._data.write(blob)
        self._next.tensors[name] = TensorEntry(str(t.dtype).removeprefix("torch."), list(t.shape),
                                               self._pos, len(blob), changed)
        self._pos += len(blob)

    def commit(self) -> DeltaIndex:
        """Publish the open version: data file in place, then the index. Returns the index."""
        index = self._next
        if index is None:
            raise DeltaError("DeltaWriter.commit before begin")
        if index.encoding != "full":
            missing = sorted(set(self.snapshot) - set(self._pending))
            if missing:
                self.abort()
                raise DeltaError(f"delta version {index.version} lacks {len(missing)} tensors of "
                                 f"its base (first: {missing[:3]}); send every weight each update")
        vdir = version_dir(self.root, index.version)
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()
        self._data = None
        os.replace(self._data_tmp, vdir / DATA_NAME)
        index.bytes_written = self._pos
        raw = index.to_json()
        index.bytes_written += len(raw)
        raw = index.to_json()  # the index counts its own bytes (digits may differ by one)
        atomic_write(vdir / INDEX_NAME, raw)
        self.snapshot, self._pending = self._pending, {}
        self.version, self._next = index.version, None
        return index

    def abort(self) -> None:
        """Drop the open version (its directory stays unpublished: no index)."""
        if self._data is not None:
            self._data.close()
            self._data = None
        if self._data_tmp is not None:
            self._data_tmp.unlink(missing_ok=True)
        self._next, self._pending = None, {}
