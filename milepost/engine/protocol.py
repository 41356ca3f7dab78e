"""SGLang's HTTP request bodies (field names and defaults as SGLang defines them).

Unknown fields are refused (400 naming the field) so a misspelled option never silently does
nothing. Fields that take one value or a batch are tagged unions chosen by the JSON shape, so a
wrong entry is reported once, under its own field, not once per union member.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from milepost.engine.sampling import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _one_or_batch(one: Any, batch: Any, one_tag: str, batch_tag: str, is_batch: Any) -> Any:
    """`one | batch`, validated only as the member the value's shape picks (tags show in error locs)."""
    return Annotated[
        Union[Annotated[one, Tag(one_tag)], Annotated[batch, Tag(batch_tag)]],
        Discriminator(lambda v: batch_tag if is_batch(v) else one_tag),
    ]


def _is_list(v: Any) -> bool:
    return isinstance(v, list)


def _is_list_of_lists(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and isinstance(v[0], list)


Text = _one_or_batch(str, list[str], "str", "list[str]", _is_list)
InputIds = _one_or_batch(list[int], list[list[int]], "list[int]", "list[list[int]]", _is_list_of_lists)
Params = _one_or_batch(SamplingParams, list[SamplingParams], "SamplingParams",
                       "list[SamplingParams]", _is_list)
Rid = _one_or_batch(str, list[str], "str", "list[str]", _is_list)


class GenerateReqInput(_Strict):
    text: Text | None = None
    input_ids: InputIds | None = None
    sampling_params: Params = Field(default_factory=SamplingParams)
    rid: Rid | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=100)
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    stream: bool = False
    # Fields sglang-router (0.3.x) adds to every /generate it forwards, with SGLang's defaults.
    # Logging switches are accepted as they come; the others only at their off value (below).
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False

    @model_validator(mode="after")
    def _check(self) -> GenerateReqInput:
        on = [f for f in ("return_hidden_states", "return_entropy", "return_bytes", "background")
              if getattr(self, f)]
        if on:
            raise ValueError(f"{', '.join(on)}: not supported by this engine; send false")
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text, input_ids: give exactly one of them (a prompt as text, "
                             "or as token ids)")
        if self.logprob_start_len != -1:
            raise ValueError(
                "logprob_start_len: only -1 (log-probs of output tokens) is supported; "
                "prompt log-probs are not returned by this engine"
            )
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def items(self) -> list[tuple[str | list[int], SamplingParams, str | None]]:
        """One (prompt, sampling params, rid) per prompt of a single or batch request."""
        prompts: list[Any] = (
            (self.text if isinstance(self.text, list) else [self.text])
            if self.text is not None
            else (self.input_ids if self.is_batch else [self.input_ids])
        )
        n = len(prompts)
        if n == 0:
            raise ValueError(f"{'text' if self.text is not None else 'input_ids'}: the batch is empty")
        params = self.sampling_params
        if isinstance(params, list):
            if len(params) != n:
                raise ValueError(f"sampling_params: {len(params)} entries for {n} prompts; "
                                 "give one per prompt, or a single object for all")
        else:
            params = [params] * n
        rids = self.rid if isinstance(self.rid, list) else [self.rid] * n
        if len(rids) != n:
            raise ValueError(f"rid: {len(rids)} entries for {n} prompts; give one per prompt")
        if n > 1 and isinstance(self.rid, str):
            raise ValueError("rid: a batch request needs a list of rids (or none)")
        return list(zip(prompts, params, rids))


class AbortReqInput(_Strict):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightVersionReqInput(_Strict):
    new_version: str
    abort_all_requests: bool = False


class UpdateWeightsFromTensorReqInput(_Strict):
    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromDiskReqInput(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class InitWeightsUpdateGroupReqInput(_Strict):
    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"


class UpdateWeightsFromDistributedReqInput(_Strict):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None

    @model_validator(mode="after")
    def _lengths(self) -> UpdateWeightsFromDistributedReqInput:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor; got "
                f"{len(self.names)}, {len(self.dtypes)}, {len(self.shapes)}"
            )
        return self


class DestroyWeightsUpdateGroupReqInput(_Strict):
    group_name: str = "weight_update_group"


# ---- readable validation errors --------------------------------------------------------------
# Pydantic reports an error inside a union once per member, with the member's type name in `loc`
# ("function-after[...]", "list[str]", "str"). Clients should read one message per field at fault.
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
