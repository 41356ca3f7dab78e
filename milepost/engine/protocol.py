"""SGLang's HTTP request bodies (field names and defaults as SGLang defines them).

Every field of SGLang's `GenerateReqInput` is accepted: honoured where it means something here,
recorded where it only labels the request (routing_key, session_id, priority, custom_labels), and
refused with a 400 naming it where it cannot apply at a non-default value (images on a text model,
LoRA, disaggregation). Unknown fields outside SGLang's schema are refused, as are non-finite numbers
and type coercions. Fields that take one value or a batch are tagged unions chosen by the JSON
shape, so a wrong entry is reported once, under its own field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from milepost.engine.sampling import SamplingParams
from milepost.engine.validation_errors import describe_validation_errors

__all__ = ["GenerateReqInput", "Item", "describe_validation_errors"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


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
Flag = _one_or_batch(bool, list[bool], "bool", "list[bool]", _is_list)
Int = _one_or_batch(int, list[int], "int", "list[int]", _is_list)
Strs = _one_or_batch(str, list[str], "str", "list[str]", _is_list)

# Fields that only have their off value here: (name, off value, why another value cannot apply).
_OFF_ONLY: list[tuple[str, Any, str]] = [
    ("input_embeds", None, "this engine takes text or input_ids"),
    ("image_data", None, "this engine serves text models"),
    ("video_data", None, "this engine serves text models"),
    ("audio_data", None, "this engine serves text models"),
    ("use_audio_in_video", False, "this engine serves text models"),
    ("modalities", None, "this engine serves text models"),
    ("return_hidden_states", False, "hidden states are not returned by this engine"),
    ("return_entropy", False, "not computed by this engine"),
    ("return_bytes", False, "only for image generation"),
    ("return_indexer_topk", False, "no sparse-attention indexer in these models"),
    ("return_cached_tokens_details", False, "this engine has one cache tier; see cached_tokens"),
    ("background", False, "background responses are not supported; send the request and wait"),
    ("lora_id", None, "adapters are picked by name: send lora_path"),
    ("custom_logit_processor", None, "serialized logit processors (code) are not run by this engine"),
    ("positional_embed_overrides", None, "this engine takes text or input_ids"),
    ("session_params", None, "SGLang's session API is not served; use milepost's session server"),
    ("bootstrap_host", None, "prefill/decode disaggregation is not supported"),
    ("bootstrap_port", None, "prefill/decode disaggregation is not supported"),
    ("bootstrap_room", None, "prefill/decode disaggregation is not supported"),
    ("bootstrap_pair_key", None, "prefill/decode disaggregation is not supported"),
    ("decode_tp_size", None, "prefill/decode disaggregation is not supported"),
    ("disagg_prefill_dp_rank", None, "prefill/decode disaggregation is not supported"),
    ("require_reasoning", False, "no hybrid-reasoning switch in this engine"),
    ("multi_item_delimiter_indices", None, "multi-item scoring is not supported"),
    ("max_dynamic_patch", None, "this engine serves text models"),
    ("min_dynamic_patch", None, "this engine serves text models"),
    ("image_max_dynamic_patch", None, "this engine serves text models"),
    ("video_max_dynamic_patch", None, "this engine serves text models"),
    ("need_wait_for_mm_inputs", None, "this engine serves text models"),
    ("num_items_assigned", None, "this engine serves text models"),
]


@dataclass
class Item:
    """One prompt of a /generate body with its own settings (a batch may give them per prompt)."""

    prompt: str | list[int]
    params: SamplingParams
    rid: str | None
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    lora_path: str | None = None  # the LoRA adapter's name (SGLang: lora_path), None = the base


class GenerateReqInput(_Strict):
    text: Text | None = None
    input_ids: InputIds | None = None
    sampling_params: Params = Field(default_factory=SamplingParams)
    rid: Rid | None = None
    return_logprob: Flag = False
    logprob_start_len: Int = -1
    top_logprobs_num: Int = 0
    token_ids_logprob: InputIds | None = None
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = Field(0, ge=0)
    return_prompt_token_ids: bool = False
    stream: bool = False
    # Labels: recorded (the router reads routing_key from its header; here it is only logged).
    model: str | None = None
    session_id: str | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    external_trace_header: dict[str, str] | None = None
    received_time: float | None = None
    log_metrics: bool = True
    no_logs: bool = False
    # A cache salt: requests with a key neither read nor fill the shared prefix cache.
    extra_key: Strs | None = None
    # One data-parallel rank here: 0 (or null) is the only rank there is.
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    # Fields kept at their off value (see _OFF_ONLY); typed loosely so the 400 names the field.
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    use_audio_in_video: Any = False
    modalities: Any = None
    return_hidden_states: Any = False
    return_entropy: Any = False
    return_bytes: Any = False
    return_indexer_topk: Any = False
    return_cached_tokens_details: Any = False
    background: Any = False
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    session_params: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    disagg_prefill_dp_rank: Any = None
    require_reasoning: Any = False
    multi_item_delimiter_indices: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """SGLang reads `null` as the field's default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data

    @model_validator(mode="after")
    def _check(self) -> GenerateReqInput:
        for name, off, why in _OFF_ONLY:
            value = getattr(self, name)
            if value != off and not (off is False and value in (None, [], [False])) \
                    and not (off is None and value in ([], [None])):
                raise ValueError(f"{name}: {why}; send {'null' if off is None else 'false'}")
        for name in ("routed_dp_rank", "data_parallel_rank"):
            if getattr(self, name) not in (None, 0):
                raise ValueError(f"{name}: this engine has one data-parallel rank; send 0 or null")
        if self.routed_experts_start_len:
            raise ValueError("routed_experts_start_len: only 0 (the whole sequence) is supported")
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text, input_ids: give exactly one of them (a prompt as text, "
                             "or as token ids)")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def items(self) -> list[Item]:
        """One Item per prompt of a single or batch request (SGLang's normalization)."""
        prompts: list[Any] = (
            (self.text if isinstance(self.text, list) else [self.text])
            if self.text is not None
            else (self.input_ids if self.is_batch else [self.input_ids])
        )
        n = len(prompts)
        if n == 0:
            raise ValueError(f"{'text' if self.text is not None else 'input_ids'}: the batch is empty")
        params = _per_item("sampling_params", self.sampling_params, n, "prompts")
        if isinstance(self.rid, str) and self.is_batch:
            rids: list[str | None] = [f"{self.rid}_{i}" for i in range(n)]  # as SGLang derives them
        else:
            rids = _per_item("rid", self.rid, n, "prompts")
        flags = _per_item("return_logprob", self.return_logprob, n, "prompts")
        starts = _per_item("logprob_start_len", self.logprob_start_len, n, "prompts")
        tops = _per_item("top_logprobs_num", self.top_logprobs_num, n, "prompts")
        ids = self.token_ids_logprob
        if ids is None or (ids and not isinstance(ids[0], list)):
            per_ids: list[Any] = [ids or None] * n
        else:
            per_ids = _per_item("token_ids_logprob", ids, n, "prompts")
        for name, values in (("logprob_start_len", starts), ("top_logprobs_num", tops)):
            low = -1 if name == "logprob_start_len" else 0
            bad = [v for v in values if v < low or (name == "top_logprobs_num" and v > 100)]
            if bad:
                raise ValueError(f"{name}: {bad[0]} is out of range "
                                 f"({'>= -1' if low else '0 to 100'})")
        loras = _per_item("lora_path", self.lora_path, n, "prompts")
        bad = [v for v in loras if v is not None and not isinstance(v, str)]
        if bad:
            raise ValueError(f"lora_path: {bad[0]!r} is not an adapter name (a string, or null for the base)")
        return [Item(prompts[i], params[i], rids[i], flags[i], starts[i], tops[i], per_ids[i] or None,
                     lora_path=loras[i]) for i in range(n)]


def _per_item(name: str, value: Any, n: int, what: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            hint = "give one per prompt, or a single value for all"
            if name == "rid":
                hint = "give one per prompt"
            raise ValueError(f"{name}: {len(value)} entries for {n} {what}; {hint}")
        return list(value)
    return [value] * n


class AbortReqInput(_Strict):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightVersionReqInput(_Strict):
    # SGLang's default for abort_all_requests is True; milepost's trainer pauses engines itself
    # and its transports send only the version, so the default stays False here (docs/engine.md).
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


