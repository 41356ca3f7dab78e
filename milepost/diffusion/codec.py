"""Trajectories on the wire: raw bytes (no base64) or JSON, and back to numpy arrays.

Raw format: b"MPTR", a little-endian u32 header length, a JSON header
{"meta": {...}, "arrays": [{"name", "dtype", "shape", "offset"}]}, then each array's bytes
(C order, little-endian). Unpacking copies nothing (`np.frombuffer` views) and checks every
offset and size against the body, so a truncated or crafted body is refused by name. This
module imports numpy only: it runs in the client's process pool, where torch is not loaded.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

MAGIC = b"MPTR"
CONTENT_TYPE = "application/x-milepost-trajectory"
_DTYPES = {"float32", "float16", "int64", "int32", "uint8"}


class TrajectoryFormatError(ValueError):
    """A trajectory body is malformed; the message names the field at fault."""


def pack(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """meta (JSON-able) and named arrays as one raw body."""
    entries, blobs, offset = [], [], 0
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype.name not in _DTYPES:
            raise TypeError(f"array {name!r} has dtype {arr.dtype.name}; send one of {sorted(_DTYPES)}")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        entries.append({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape), "offset": offset})
        blobs.append(arr.tobytes())
        offset += arr.nbytes
    header = json.dumps({"meta": dict(meta), "arrays": entries}).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, *blobs])


def unpack(body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of a raw body; TrajectoryFormatError naming what does not fit."""
    if len(body) < 8 or body[:4] != MAGIC:
        raise TrajectoryFormatError("trajectory body does not start with b'MPTR' (not a raw trajectory)")
    (n,) = struct.unpack_from("<I", body, 4)
    if 8 + n > len(body):
        raise TrajectoryFormatError(f"trajectory header length {n} runs past the body ({len(body)} bytes)")
    try:
        header = json.loads(body[8:8 + n])
        meta, entries = header["meta"], header["arrays"]
    except (ValueError, KeyError, TypeError) as e:
        raise TrajectoryFormatError(f"trajectory header is not valid JSON with meta and arrays ({e})") from e
    data, arrays = memoryview(body)[8 + n:], {}
    for e in entries:
        name = e.get("name")
        if e.get("dtype") not in _DTYPES:
            raise TrajectoryFormatError(f"array {name!r}: dtype {e.get('dtype')!r} is not one of {sorted(_DTYPES)}")
        dtype = np.dtype(e["dtype"]).newbyteorder("<")
        shape = tuple(int(s) for s in e["shape"])
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        start = int(e["offset"])
        if start < 0 or start + size > len(data):
            raise TrajectoryFormatError(f"array {name!r}: bytes {start}..{start + size} run past the body")
        arrays[name] = np.frombuffer(data[start:start + size], dtype=dtype).reshape(shape)
    return meta, arrays


def to_json(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """The JSON path (what the raw path is measured against): arrays as nested lists."""
    body = {"meta": dict(meta), "arrays": {k: {"dtype": v.dtype.name, "data": v.tolist()} for k, v in arrays.items()}}
    return json.dumps(body).encode()


def from_json(body: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    try:
        doc = json.loads(body)
        arrays = {k: np.asarray(v["data"], dtype=v["dtype"]) for k, v in doc["arrays"].items()}
        return doc["meta"], arrays
    except (ValueError, KeyError, TypeError) as e:
        raise TrajectoryFormatError(f"JSON trajectory is malformed ({e})") from e


def decode(body: bytes, content_type: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Either format by its content type (a process-pool entry point: numpy arrays pickle back)."""
    if content_type.startswith(CONTENT_TYPE):
        return unpack(body)  # read-only views of `body`; a pool pickles them back as copies
    return from_json(body)
