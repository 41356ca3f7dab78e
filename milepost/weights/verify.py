"""Prove that every engine holds exactly the weights the trainer sent (opt-in: check_weight_update).

Both sides digest each tensor the same way (`tensor_digest`: sha256 over dtype, shape and raw
bytes), the engine over `GET /weights_checksum` (milepost/engine/weight_check.py) under Hugging
Face names. Exact, not approximate: the engine stores the dtype it received, so any differing
bit is a failed update. The exception is a tensor the engine stores quantized (`--quantization
fp8`): it is compared by value, each element within the error bound its format gives
(milepost/weights/fp8.py), so the trainer keeps a host copy of those tensors (names from
`GET /weights_quantized`) while a check runs. A real SGLang server has none of these endpoints;
verification is ours only.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from milepost.auth import client_headers
from milepost.http_tls import tls_context
from milepost.lowprec.quantize import FORMATS as LOWPREC_FORMATS
from milepost.lowprec.quantize import error_bound as lowprec_bound
from milepost.weights.codec import deserialize_named_tensors
from milepost.weights.fp8 import FORMAT, fp8_error_bound

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
    version, sums, _ = fetch_state(url, timeout_s)
    return version, sums


def fetch_state(url: str, timeout_s: float = 120.0) -> tuple[str, dict[str, str], dict[str, str]]:
    """(weight_version, {hf_name: digest}, {hf_name: format of a tensor stored quantized})."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/weights_checksum", timeout=timeout_s,
                      headers=client_headers(), verify=tls_context())
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
    return str(body["weight_version"]), dict(body["checksums"]), dict(body.get("quantized", {}))


def quantized_names(engine_urls: Sequence[str], timeout_s: float = 120.0) -> set[str]:
    """Names any engine stores quantized (those the trainer must keep values of to check)."""
    names: set[str] = set()
    for url in engine_urls:
        try:
            r = httpx.get(f"{url.rstrip('/')}/weights_quantized", timeout=timeout_s,
                          headers=client_headers(), verify=tls_context())
        except httpx.HTTPError as e:
            raise WeightMismatchError(f"engine {url}: GET /weights_quantized failed ({e})") from e
        if r.status_code == 404:
            continue  # an engine without the endpoint stores nothing quantized we know of
        if r.status_code != 200:
            raise WeightMismatchError(f"engine {url}: GET /weights_quantized answered "
                                      f"{r.status_code}: {r.text}")
        names |= set(r.json()["names"])
    return names


def check_quantized(url: str, sent: Mapping[str, torch.Tensor], timeout_s: float = 120.0
                    ) -> list[str]:
    """Names of `sent` whose values on the engine at `url` (stored quantized) are off by more
    than the format's error bound, each with its worst element's error over the bound."""
    if not sent:
        return []
    r = httpx.post(f"{url.rstrip('/')}/weights_dequantized", json={"names": list(sent)},
                   timeout=timeout_s, headers=client_headers(), verify=tls_context())
    if r.status_code != 200:
        raise WeightMismatchError(f"engine {url}: POST /weights_dequantized answered "
                                  f"{r.status_code}: {r.text}")
    fmt = r.json().get("format")
    if fmt != FORMAT and fmt not in LOWPREC_FORMATS:
        raise WeightMismatchError(f"engine {url} stores format {fmt!r}; this trainer checks "
                                  f"{FORMAT!r} and {', '.join(LOWPREC_FORMATS)}")
    held = dict(deserialize_named_tensors(r.json()["tensors"]))
    off = []
    for name, x in sent.items():
        values, scale = held[name], held[f"{name}:scale"]
        if values.shape != x.shape:
            off.append(f"{name} (shape {list(values.shape)}, sent {list(x.shape)})")
            continue
        # Row format: one scale per row; the block formats: the scale of every element.
        bound = fp8_error_bound(x, scale) if fmt == FORMAT else lowprec_bound(fmt, x, scale)
        ratio = ((values - x.float()).abs() / bound).max().item()
        if not ratio <= 1.0:  # NaN fails too
            off.append(f"{name} (error {ratio:.3g}x the {fmt} bound)")
    return off


def randomize_engines(engine_urls: Sequence[str], seed: int = 0, timeout_s: float = 120.0,
                      prefix: str | None = None) -> None:
    """Fill every weight of every engine (those named `prefix...` only, when given) with seeded
    noise (`POST /weights_randomize`)."""
    body = {"seed": seed} if prefix is None else {"seed": seed, "prefix": prefix}
    for url in engine_urls:
        try:
            r = httpx.post(f"{url.rstrip('/')}/weights_randomize", json=body,
                           timeout=timeout_s, headers=client_headers(), verify=tls_context())
        except httpx.HTTPError as e:
            raise WeightMismatchError(f"engine {url}: POST /weights_randomize failed ({e})") from e
        if r.status_code != 200:
            raise WeightMismatchError(
                f"engine {url}: POST /weights_randomize answered {r.status_code}: {r.text}; "
                "--check-weight-update-equal needs milepost's embedded engine")


def _skipped(name: str, skip: Sequence[str]) -> bool:
    """Skipped: `name` matches a glob of `skip`, or `skip` has negated globs ("!glob": check only
    what matches one of them, e.g. the MTP draft's layer) and it matches none of them."""
    only = [p[1:] for p in skip if p.startswith("!")]
    if only and not any(fnmatch.fnmatchcase(name, p) for p in only):
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in skip if not p.startswith("!"))


def compare_digests(
    expected: Mapping[str, str], engine_urls: Sequence[str], timeout_s: float = 120.0,
    *, require_all: bool = False, skip: Sequence[str] = (),
    values: Mapping[str, torch.Tensor] | None = None, scope: str | None = None,
) -> int:
    """Check every engine against `expected` ({name: digest}); returns how many tensors matched
    per engine. Raises WeightMismatchError naming each engine at fault and its first tensors.

    require_all: every tensor the engine holds (except names matching a `skip` glob) must be in
    `expected`, so a tensor the update never wrote is a failure, not a silent omission.
    values: what was sent for the names an engine stores quantized (`quantized_names`); those
    are compared within their format's error bound instead of by digest.
    scope: with require_all, only the engine's tensors named `scope...` must all be in `expected`
    (a LoRA run updates its adapter, "policy/", and never the base).
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
        version, held, quantized = answer
        missing = [n for n in expected if n not in held and n not in quantized
                   and not _skipped(n, skip)]
        differ = [n for n in expected if n in held and held[n] != expected[n]
                  and not _skipped(n, skip)]
        by_value = {n: (values or {}).get(n) for n in expected
                    if n in quantized and not _skipped(n, skip)}
        differ += [f"{n} (stored {quantized[n]}; the trainer kept no values to compare)"
                   for n, v in by_value.items() if v is None]
        differ += check_quantized(url, {n: v for n, v in by_value.items() if v is not None},
                                  timeout_s)
        unsent = ([n for n in [*held, *quantized] if n not in expected and not _skipped(n, skip)
                   and n.startswith(scope or "")] if require_all else [])
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
    """Check that every engine holds exactly `named_weights` (in the dtype given here; tensors
    an engine stores quantized within their format's bound).

    Returns the number of tensors checked per engine. Engines are read on their engine thread,
    so call this with no weight update in flight.
    """
    quantized = quantized_names(engine_urls, timeout_s)
    digests, values = {}, {}
    for name, t in named_weights:
        digests[name] = tensor_digest(t)
        if name in quantized:
            values[name] = t.detach().to("cpu", copy=True)
    return compare_digests(digests, engine_urls, timeout_s, values=values)


def _try_fetch(url: str, timeout_s: float
               ) -> tuple[str, dict[str, str], dict[str, str]] | WeightMismatchError:
    try:
        return fetch_state(url, timeout_s)
    except WeightMismatchError as e:
        return e
