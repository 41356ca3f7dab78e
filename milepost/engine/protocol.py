"""SGLang's HTTP request bodies (field names and defaults as SGLang defines them).

Unknown top-level fields are refused (422 naming the field) so a misspelled option never silently
does nothing; SGLang fields this engine does not implement are listed and refused with a message.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from milepost.engine.sampling import SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateReqInput(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] = Field(default_factory=SamplingParams)
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=100)
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    stream: bool = False

    @model_validator(mode="after")
    def _check(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text' or 'input_ids'")
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
        params = self.sampling_params
        if isinstance(params, list):
            if len(params) != n:
                raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
        else:
            params = [params] * n
        rids = self.rid if isinstance(self.rid, list) else [self.rid] * n
        if len(rids) != n:
            raise ValueError(f"rid has {len(rids)} entries for {n} prompts")
        if n > 1 and isinstance(self.rid, str):
            raise ValueError("a batch request needs a list of rids (or none)")
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
