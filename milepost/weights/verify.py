"""Prove that every engine holds exactly the weights the trainer sent (opt-in: check_weight_update).

Both sides digest each tensor the same way (`tensor_digest`: sha256 over dtype, shape and raw
bytes), the engine over `GET /weights_checksum` (milepost/engine/weight_check.py) under Hugging
Face names. Exact, not approximate: the engine stores the dtype it received, so any differing
bit is a failed update. A real SGLang server has no such endpoint; verification is ours only.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

_LISTED = 10  # mismatching tensors named per engine; the count says the rest


class WeightMismatchError(RuntimeError):
    """An engine holds weights other than the ones the trainer sent; the message names it."""


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 hex of a tensor's dtype, shape and element bytes (layout-independent)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}|{list(tensor.shape)}|".encode())
    if t.numel():
        h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.hexdigest()


def digest_named(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: tensor_digest} of every tensor in `named` (consumes the iterable)."""
    return {name: tensor_digest(t) for name, t in named}


def fetch_checksums(url: str, timeout_s: float = 120.0) -> tuple[str, dict[str, str]]:
    """(weight_version, {hf_name: digest}) that the engine at `url` reports."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/weights_checksum", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise WeightMismatchError(
            f"engine {url}: GET /weights_checksum failed ({type(e).__name__}: {e}); is it running?"
        ) from e
    if r.status_code == 404:
        raise WeightMismatchError(
            f"engine {url} has no /weights_checksum (a real SGLang server lacks it); "
            "turn check_weight_update off for this engine backend"
        )
    if r.status_code != 200:
        raise WeightMismatchError(f"engine {url}: GET /weights_checksum answered {r.status_code}: {r.text}")
    body = r.json()
    return str(body["weight_version"]), dict(body["checksums"])


def randomize_engines(engine_urls: Sequence[str], seed: int = 0, timeout_s: float = 120.0) -> None:
    """Fill every weight of every engine with seeded noise (`POST /weights_randomize`)."""
    for url in engine_urls:
        try:
            r = httpx.post(f"{url.rstrip('/')}/weights_randomize", json={"seed": seed},
                           timeout=timeout_s)
        except httpx.HTTPError as e:
            raise WeightMismatchError(f"engine {url}: POST /weights_randomize failed ({e})") from e
        if r.status_code != 200:
            raise WeightMismatchError(
                f"engine {url}: POST /weights_randomize answered {r.status_code}: {r.text}; "
                "--check-weight-update-equal needs milepost's embedded engine")


def _skipped(name: str, skip: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def compare_digests(
    expected: Mapping[str, str], engine_urls: Sequence[str], timeout_s: float = 120.0,
    *, require_all: bool = False, skip: Sequence[str] = (),
) -> int:
    """Check every engine against `expected` ({name: digest}); returns how many tensors matched
    per engine. Raises WeightMismatchError naming each engine at fault and its first tensors.

    require_all: every tensor the engine holds (except names matching a `skip` glob) must be in
    `expected`, so a tensor the update never wrote is a failure, not a silent omission.
    """
    if not expected:
        raise ValueError("compare_digests: nothing to compare (expected is empty)")
    with ThreadPoolExecutor(max(1, len(engine_urls))) as pool:
        answers = list(pool.map(lambda u: _try_fetch(u, timeout_s), engine_urls))
    failures = []
    for url, answer in zip(engine_urls, answers):
        if isinstance(answer, WeightMismatchError):
            failures.append(str(answer))
            continue
        version, held = answer
        missing = [n for n in expected if n not in held and not _skipped(n, skip)]
        differ = [n for n in expected if n in held and held[n] != expected[n]
                  and not _skipped(n, skip)]
        unsent = ([n for n in held if n not in expected and not _skipped(n, skip)]
                  if require_all else [])
        if missing or differ or unsent:
            parts = []
            if unsent:
                parts.append(f"{len(unsent)} never written by the update: "
                             f"{', '.join(unsent[:_LISTED])}" + (" ..." if len(unsent) > _LISTED else ""))
            if differ:
                parts.append(f"{len(differ)} differ: {', '.join(differ[:_LISTED])}"
                             + (" ..." if len(differ) > _LISTED else ""))
            if missing:
                parts.append(f"{len(missing)} unknown to the engine: {', '.join(missing[:_LISTED])}"
                             + (" ..." if len(missing) > _LISTED else ""))
            failures.append(f"engine {url} (weight_version {version!r}) holds other weights than "
                            f"the trainer sent: {'; '.join(parts)} (of {len(expected)} tensors)")
    if failures:
        raise WeightMismatchError("weight check failed:\n  - " + "\n  - ".join(failures))
    return len(expected)


def verify(
    named_weights: Iterable[tuple[str, torch.Tensor]],
    engine_urls: Sequence[str],
    timeout_s: float = 120.0,
) -> int:
    """Check that every engine holds exactly `named_weights` (in the dtype given here).

    Returns the number of tensors checked per engine. Engines are read on their engine thread,
    so call this with no weight update in flight.
    """
    return compare_digests(digest_named(named_weights), engine_urls, timeout_s)


def _try_fetch(url: str, timeout_s: float) -> tuple[str, dict[str, str]] | WeightMismatchError:
    try:
        return fetch_checksums(url, timeout_s)
    except WeightMismatchError as e:
        return e
