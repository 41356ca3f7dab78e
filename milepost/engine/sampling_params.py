"""SGLang's `sampling_params`: every field of current SGLang, with its name, default and range.

`null` for a field means its default, as in SGLang (for `max_new_tokens` that is SGLang's "up to
the context length", resolved by the server). `structural_tag`, which this engine cannot honour,
is accepted at its off value and refused with a 400 naming it otherwise; grammars compile in
grammar.py. Unknown keys,
non-finite numbers and type coercions ("1" for 1, true for 1) are refused.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GREEDY_EPS = 1e-5

# JSON values a custom logit processor may receive (SGLang's CustomParamValue).
_Scalar = None | bool | int | float | str
CustomParamValue = _Scalar | list[_Scalar] | dict[str, _Scalar]

_GRAMMARS = ("json_schema", "regex", "ebnf")  # structured output (grammar.py)


class SamplingParams(BaseModel):
    """SGLang's `sampling_params`; unknown keys are refused so a typo never silently does nothing."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    max_new_tokens: int | None = Field(
        128, ge=0, description="Most tokens to generate; null = up to the context length.")
    min_new_tokens: int = Field(0, ge=0, description="Stop tokens are banned until this many.")
    temperature: float = Field(1.0, ge=0.0, description="0 (or < 1e-5) means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept (at least one token).")
    top_k: int = Field(-1, description="Keep the k most likely tokens; -1 or 0 keeps all.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob.")
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted once per earlier output of the token.")
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from every token already output.")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=2.0, description="Divides (positive) or multiplies (negative) the logit "
        "of every token already output; 1 = off.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string key) -> value added to its logit.")
    stop: str | list[str] | None = Field(None, description="Stop strings (not in the output text).")
    stop_token_ids: list[int] | None = Field(None, description="Extra token ids that stop.")
    stop_regex: str | list[str] | None = Field(
        None, description="Regular expressions; generation stops when the output text matches one.")
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    n: int = Field(1, ge=1, le=1024, description="Independent samples of this prompt.")
    sampling_seed: int | None = Field(None, description="Seed for reproducible sampling.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from output text.")
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = Field(False, description="Keep the matched stop string in the text.")
    stream_interval: int | None = Field(
        None, ge=1, description="Streaming: send a chunk every this many tokens (default 1).")
    custom_params: dict[str, CustomParamValue] | None = Field(
        None, description="Passed to a custom logit processor (recorded; this engine runs none).")
    json_schema: str | None = Field(
        None, description="Structured output: a JSON schema (a JSON string) the text must follow.")
    regex: str | None = Field(None, description="Structured output: a regular expression.")
    ebnf: str | None = Field(None, description="Structured output: a GBNF grammar (rule root).")
    structural_tag: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """SGLang treats `null` as "use the default"; max_new_tokens keeps null (no limit)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k == "max_new_tokens" or k not in cls.model_fields}
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("top_k must be -1 (off) or a positive number of tokens")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("stop_regex")
    @classmethod
    def _stop_regex(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        patterns = [v] if isinstance(v, str) else v
        for p in patterns:
            if p == "":
                raise ValueError("stop_regex patterns must be non-empty")
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"stop_regex {p!r} is not a valid regular expression ({e})") from e
        return patterns

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None:
            for key in v:
                if not re.fullmatch(r"\d+", key):
                    raise ValueError(f"logit_bias key {key!r} is not a token id (a non-negative "
                                     "integer written as a string)")
        return v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if self.structural_tag is not None:
            raise ValueError("structural_tag: not supported by this engine; use json_schema, "
                             "regex or ebnf (or send null)")
        grammars = [f for f in _GRAMMARS if getattr(self, f) is not None]
        if len(grammars) > 1:  # SGLang's rule too
            raise ValueError(f"{' and '.join(grammars)}: only one of json_schema, regex and ebnf "
                             "can be set")
        if any(getattr(self, f) == "" for f in grammars):
            raise ValueError(f"{grammars[0]}: the grammar is empty; send null for no grammar")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """True when the output so far changes the logits (penalties)."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def adjusts_logits(self) -> bool:
        """True when the sampler must change this row's logits before sampling."""
        return self.penalized or bool(self.logit_bias)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, text) of the structured-output grammar, or None."""
        for f in _GRAMMARS:
            if getattr(self, f) is not None:
                return f, getattr(self, f)
        return None

    def bias_ids(self) -> list[int]:
        return [int(k) for k in self.logit_bias or {}]
