"""Readable validation errors: one `field.path: message` per field the client got wrong.

Pydantic reports an error inside a union once per member, with the member's type name in `loc`
("function-after[...]", "list[str]", "str"); clients should read one message per field at fault.
"""

from __future__ import annotations

import re

_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "bytes", "none"}
_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_NAMES_FIELD = re.compile(r"[a-z_][a-z0-9_.\[\], ]*: ")  # "logprob_start_len: only -1 ..."


def _is_field(part: object) -> bool:
    return isinstance(part, int) or (
        isinstance(part, str) and _FIELD.fullmatch(part) is not None and part not in _TYPE_NAMES
    )


def _path(parts: list[object]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _message(err: dict) -> str:
    kind, msg = err.get("type", ""), str(err.get("msg", ""))
    if kind == "extra_forbidden":
        return "unknown field (not a parameter this endpoint accepts; check the spelling)"
    if kind in ("model_attributes_type", "model_type", "dict_type"):
        return f"expected a JSON object, got {_kind(err)}"
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def describe_validation_errors(errors: list[dict]) -> str:
    """One `field.path: message` per field at fault, from pydantic/FastAPI error dicts.

    Of a union's members, only those whose type matched the input (the error is inside the member,
    not "should be a valid list" at its root) are reported; members that all mismatch are joined
    with "or". A body that is not JSON, or not a JSON object, gets a message saying so.
    """
    rows = []  # (union prefix, member tag, field path, depth inside member, root type mismatch, err)
    for err in errors:
        loc = list(err.get("loc", ()))
        if loc and loc[0] == "body":
            loc = loc[1:]
        if err.get("type") == "json_invalid":
            where = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
            detail = (err.get("ctx") or {}).get("error", "")
            return f"body: malformed JSON{where}" + (f" ({detail})" if detail else "") + \
                "; send one JSON object"
        if not loc and err.get("type") in ("model_attributes_type", "model_type", "dict_type", "missing"):
            return f"body: expected a JSON object of the request's fields, got {_kind(err)}"
        tag_at = next((i for i, p in enumerate(loc) if not _is_field(p)), None)
        fields = [p for p in loc if _is_field(p)]
        if tag_at is None:
            rows.append(((), None, fields, 0, False, err))
            continue
        inner = [p for p in loc[tag_at + 1:] if _is_field(p)]
        root_mismatch = not inner and str(err.get("type", "")).endswith("_type")
        rows.append((tuple(loc[:tag_at]), loc[tag_at], fields, len(inner), root_mismatch, err))

    keep = []
    for row in rows:
        prefix, tag = row[0], row[1]
        if tag is None:
            keep.append(row)
            continue
        members = [r for r in rows if r[1] is not None and r[0] == prefix]
        matched = {r[1] for r in members if not r[4]}
        if matched and tag not in matched:
            continue  # this member's type did not match the input; another one did
        deepest = max((r[3] for r in members if r[1] in matched or not matched), default=0)
        if max(r[3] for r in members if r[1] == tag) < deepest:
            continue  # another member got further into the input
        keep.append(row)

    by_path: dict[str, list[str]] = {}
    for _, _, fields, _, _, err in keep:
        m = _message(err)
        path = _path(fields) or ("" if _NAMES_FIELD.match(m) else "body")
        msgs = by_path.setdefault(path, [])
        if m not in msgs:
            msgs.append(m)
    return "; ".join(f"{path}: {' or '.join(msgs)}" if path else " ".join(msgs)
                     for path, msgs in by_path.items())


def _kind(err: dict) -> str:
    got = err.get("input")
    if err.get("type") == "missing":
        return "an empty body"
    if isinstance(got, bytes):  # FastAPI parses JSON only when the content type says JSON
        return "a body that is not JSON (send it with Content-Type: application/json)"
    names = {type(None): "null", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number"}
    return names.get(type(got), type(got).__name__)
