"""An engine host's side of disk-delta (milepost.weights.disk_delta): its local copy, patched.

`prepare` reads a published version, applies it to a candidate copy of the tensors this host
holds and checks every digest of the result; `adopt` makes the candidate current once the engine
loaded it. Nothing changes on a refusal (wrong base, corrupt data, digest mismatch).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import zstandard

from milepost.weights.disk_delta import (
    _INT_OF_SIZE,
    DATA_NAME,
    DeltaError,
    DeltaIndex,
    TensorEntry,
    as_bytes,
    read_index,
    tensor_digest,
    version_dir,
)


class DeltaReplica:
    """An engine host's local copy: the tensors of the version it applied last, on the host.

    `prepare` reads and checks a version without touching the copy; `adopt` makes the prepared
    state current once the engine has loaded it.
    """

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self._dctx = zstandard.ZstdDecompressor()

    def prepare(self, root: Path, version: int) -> tuple[DeltaIndex, dict[str, torch.Tensor]]:
        """(index, the full resulting state) of applying `version` on top of this copy.

        Refuses, changing nothing, a version not on this copy's version (the XOR-twice and
        wrong-base cases), a corrupt data file, or a result whose digests differ from the index.
        """
        index = read_index(root, version)
        # Overwrite is idempotent: re-applying the version this copy already holds is harmless.
        again = index.encoding == "overwrite" and version == self.version
        if index.base_version is not None and index.base_version != self.version and not again:
            held = "no version" if self.version is None else f"version {self.version}"
            raise DeltaError(
                f"delta version {version} ({index.encoding}) applies on top of version "
                f"{index.base_version}, but this engine holds {held}; apply the versions in order, "
                "each exactly once (an XOR delta applied twice would undo itself)")
        data_path = version_dir(root, version) / DATA_NAME
        try:
            data = data_path.read_bytes()
        except OSError as e:
            raise DeltaError(f"delta version {version}: cannot read {data_path} ({e})") from e
        state = {} if index.base_version is None else dict(self.state)
        for name, entry in index.tensors.items():
            state[name] = self._decode(version, index.encoding, name, entry, data,
                                       state.get(name))
        problems = _digest_problems(index, state)
        if problems:
            raise DeltaError(f"delta version {version} under {root} does not produce the trainer's "
                             f"weights ({len(problems)} problems; nothing was loaded): "
                             + "; ".join(problems[:10]))
        return index, state

    def _decode(self, version: int, encoding: str, name: str, e: TensorEntry, data: bytes,
                old: torch.Tensor | None) -> torch.Tensor:
        dtype = getattr(torch, e.dtype, None)
        if not isinstance(dtype, torch.dtype) or e.offset < 0 or e.offset + e.length > len(data):
            raise DeltaError(f"delta version {version}: entry {name} is malformed "
                             f"(dtype {e.dtype!r}, bytes {e.offset}+{e.length} of {len(data)})")
        try:
            payload = self._dctx.decompress(data[e.offset:e.offset + e.length])
        except zstandard.ZstdError as err:
            raise DeltaError(f"delta version {version}: the data of {name} is corrupt ({err}); "
                             "republish the version") from err
        numel = 1
        for d in e.shape:
            numel *= int(d)
        nbytes = numel * dtype.itemsize
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
            torch.empty(0, dtype=torch.uint8)
        if old is None and encoding != "full":
            raise DeltaError(f"delta version {version}: {name} is not in this engine's copy; "
                             "a delta needs the same names as its base")
        if encoding == "full":
            if raw.numel() != nbytes:
                raise DeltaError(f"delta version {version}: {name} holds {raw.numel()} bytes, "
                                 f"its shape {e.shape} {e.dtype} needs {nbytes}")
            return raw.view(dtype).reshape(e.shape)
        if old.dtype != dtype or list(old.shape) != list(e.shape):
            raise DeltaError(f"delta version {version}: {name} is {e.dtype} {e.shape} in the delta "
                             f"but {old.dtype} {list(old.shape)} in this engine's copy")
        if encoding == "xor":
            if raw.numel() != nbytes:
                raise DeltaError(f"delta version {version}: {name} xor payload has {raw.numel()} "
                                 f"bytes, the tensor {nbytes}")
            return torch.bitwise_xor(as_bytes(old), raw).view(dtype).reshape(e.shape)
        ints = _INT_OF_SIZE[dtype.itemsize]
        pos_size = 4 if numel < 2**31 else 8
        if raw.numel() != e.changed * (pos_size + dtype.itemsize):
            raise DeltaError(f"delta version {version}: {name} overwrite payload has "
                             f"{raw.numel()} bytes, {e.changed} changes need "
                             f"{e.changed * (pos_size + dtype.itemsize)}")
        pos = raw[:e.changed * pos_size].view(torch.int32 if pos_size == 4 else torch.int64).long()
        values = raw[e.changed * pos_size:].view(ints)
        if e.changed and (int(pos.min()) < 0 or int(pos.max()) >= numel):
            raise DeltaError(f"delta version {version}: {name} overwrite positions out of range")
        new = old.detach().clone().reshape(-1).view(ints)
        new[pos] = values
        return new.view(dtype).reshape(e.shape)

    def adopt(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        self.state, self.version = dict(state), version


def _digest_problems(index: DeltaIndex, state: Mapping[str, torch.Tensor]) -> list[str]:
    problems = [f"{n}: missing from the result" for n in index.digests if n not in state]
    problems += [f"{n}: not in the version's digests" for n in state if n not in index.digests]
    problems += [f"{n}: digest differs" for n, d in index.digests.items()
                 if n in state and tensor_digest(state[n]) != d]
    return problems
