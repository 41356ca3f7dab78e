"""OpenAI-compatible endpoints: `/v1/completions` and `/v1/chat/completions` (openai_chat.py).

They run on the same GenerateService as `/generate`. Every field is honoured or refused by name:
the request models forbid unknown fields, a few that change nothing in the answer (`user`,
`metadata`, `store`, `service_tier`) are accepted and unused, and SGLang's extensions that
sglang-router writes into every request are honoured or accepted at their no-op value.
Penalties and logit_bias are the sampler's own (SGLang semantics). Non-finite numbers and type
coercions are refused.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from milepost.engine.grammar import response_format_params
from milepost.engine.openai_chat import chat_completion
from milepost.engine.protocol import GenerateReqInput
from milepost.engine.sampling import SamplingParams
from milepost.session.families import Family

# OpenAI fields that change nothing in the answer: accepted, not used.
ACCEPTED_UNUSED = frozenset({"user", "metadata", "store", "service_tier"})


class _OpenAIBase(BaseModel):
    # Unknown fields are refused (400 naming them): a field we do not read must not look honoured.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str = "default"
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # SGLang's extensions (sglang-router sends the flags below in every request, at defaults).
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # Structured output (helper D): the one place that reads response_format.
    response_format: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_unused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if k not in ACCEPTED_UNUSED}
        return data

    @model_validator(mode="after")
    def _off_only(self) -> _OpenAIBase:
        if self.return_hidden_states:
            raise ValueError("return_hidden_states: not supported by this engine; send false")
        response_format_params(self.response_format)  # a malformed one: 400 naming its part
        if self.stream_options is not None and (set(self.stream_options) - {"include_usage"}):
            raise ValueError(f"stream_options: only include_usage is supported, got "
                             f"{sorted(self.stream_options)}")
        return self

    def max_new_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 128

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens(),
            temperature=self.temperature, top_p=self.top_p, n=self.n, stop=self.stop,
            sampling_seed=self.seed, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, logit_bias=self.logit_bias,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            min_new_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim, **response_format_params(self.response_format),
        )


def _prompt_shape(v: Any) -> str:
    if isinstance(v, str):
        return "str"
    if isinstance(v, list) and v and isinstance(v[0], str):
        return "list[str]"
    if isinstance(v, list) and v and isinstance(v[0], list):
        return "list[list[int]]"
    return "list[int]"


# OpenAI's four prompt forms: text, token ids, and a batch of either.
Prompt = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[str], Tag("list[str]")] | Annotated[list[int], Tag("list[int]")] | Annotated[list[list[int]], Tag("list[list[int]]")],
    Discriminator(_prompt_shape),
]


class CompletionRequest(_OpenAIBase):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False

    @model_validator(mode="after")
    def _no_logprobs(self) -> CompletionRequest:
        if self.logprobs is not None:
            raise ValueError("logprobs: not supported on /v1/completions; use /generate with "
                             "return_logprob=true")
        if self.echo:
            raise ValueError("echo: not supported; the prompt is not returned")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        shape = _prompt_shape(self.prompt)
        return list(self.prompt) if shape in ("list[str]", "list[list[int]]") else [self.prompt]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)  # a tool message answers it by this id
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]  # the engine serves text models
    text: str


class ChatMessage(BaseModel):
    # Other fields (name, reasoning_content, ...) reach the chat template as sent.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        m = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            m["content"] = "".join(p.text for p in self.content)
        return m


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)  # what sglang-router sends
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    continue_final_message: bool = False
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @model_validator(mode="after")
    def _fields(self) -> ChatCompletionRequest:
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError(f"max_completion_tokens: {self.max_completion_tokens} differs from "
                             f"max_tokens {self.max_tokens}; send one of them")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.logprobs and self.stream:
            raise ValueError("logprobs: not supported with stream; use stream: false")
        if self.tool_choice not in ("auto", "none"):
            raise ValueError("tool_choice: only 'auto' and 'none' are supported ('required' and a "
                             "named function need constrained decoding)")
        if not self.parallel_tool_calls:
            raise ValueError("parallel_tool_calls: false needs constrained decoding, not "
                             "supported; send true or leave it out")
        if not (self.separate_reasoning and self.stream_reasoning):
            raise ValueError("separate_reasoning / stream_reasoning: only true is supported (the "
                             "family's parser always separates reasoning)")
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise ValueError(f"messages[{i}].tool_call_id: a tool message must name the tool "
                                 f"call it answers")
        return self

    def max_new_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().max_new_tokens()


def _finish(meta: dict) -> str:
    return "length" if meta["finish_reason"]["type"] == "length" else "stop"


def openai_router(service: object, family: Family | None = None) -> APIRouter:
    """`family`: the model family whose parsers read chat answers (--tool-call-parser)."""
    from milepost.engine.server import OPENAI_NAMES, BadRequest, GenerateService

    assert isinstance(service, GenerateService)
    router = APIRouter()

    async def run(prompts: list[list[int]], req: _OpenAIBase, field: str, http: HttpRequest,
                  ) -> tuple[list[dict], dict]:
        """Outputs in OpenAI's choice order (prompt-major, then the n samples), and usage."""
        if req.stream:
            raise BadRequest("stream: streaming is not supported on /v1 endpoints; use /generate")
        batch = len(prompts) > 1
        body = GenerateReqInput(input_ids=prompts if batch else prompts[0],
                                sampling_params=req.sampling())
        seqs = await service.expand(body, names=replace(OPENAI_NAMES, prompt=field))
        outs = await service.run_all(seqs, body, http.is_disconnected)
        usage = {
            "prompt_tokens": sum(len(p) for p in prompts),
            "completion_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return outs, usage

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, http: HttpRequest) -> dict:
        prompts = req.prompts
        ids = await service.tokenize_all(
            [(p, f"prompt[{i}]" if len(prompts) > 1 else "prompt") for i, p in enumerate(prompts)])
        outs, usage = await run(ids, req, "prompt", http)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": req.model, "usage": usage,
            "choices": [{"index": i, "text": o["text"], "finish_reason": _finish(o["meta_info"]),
                         "logprobs": None} for i, o in enumerate(outs)],
        }

    @router.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, http: HttpRequest) -> Any:
        return await chat_completion(service, req, http, family)

    return router
