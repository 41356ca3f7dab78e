"""OpenAI-compatible basics: `/v1/completions` and `/v1/chat/completions` (non-streaming).

They run on the same GenerateService as `/generate`; chat prompts are rendered with the
checkpoint's own chat template. Tools and streaming for agents live in the session server.
Unknown OpenAI fields are ignored (clients send many), but the ones that would change the
answer (log-probs, echo) are refused rather than silently dropped; penalties and logit_bias are
the sampler's own (SGLang semantics). Non-finite numbers and type coercions are refused.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Annotated, Any, Union

from fastapi import APIRouter, Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from milepost.engine.protocol import GenerateReqInput
from milepost.engine.sampling import SamplingParams


class _OpenAIBase(BaseModel):
    # Clients send many optional fields we do not use; the ones read are strictly typed.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str = "default"
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_tokens if self.max_tokens is not None else 128,
            temperature=self.temperature, top_p=self.top_p, n=self.n, stop=self.stop,
            sampling_seed=self.seed, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, logit_bias=self.logit_bias,
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
    Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("list[str]")],
          Annotated[list[int], Tag("list[int]")], Annotated[list[list[int]], Tag("list[list[int]]")]],
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False

    @model_validator(mode="after")
    def _no_logprobs(self) -> ChatCompletionRequest:
        if self.logprobs:
            raise ValueError("logprobs: not supported on /v1/chat/completions; use /generate "
                             "with return_logprob=true")
        return self


def _finish(meta: dict) -> str:
    return "length" if meta["finish_reason"]["type"] == "length" else "stop"


def openai_router(service: object) -> APIRouter:
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
    async def chat(req: ChatCompletionRequest, http: HttpRequest) -> dict:
        if service.tokenizer is None or not getattr(service.tokenizer, "chat_template", None):
            raise BadRequest("messages: this model has no chat template; use /v1/completions")
        try:
            ids = service.tokenizer.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in req.messages],
                add_generation_prompt=True, tokenize=True, return_dict=False,
            )
        except Exception as e:  # noqa: BLE001 - the template raises whatever its author chose
            raise BadRequest(
                f"messages: the model's chat template cannot render them ({type(e).__name__}: {e})"
            ) from e
        outs, usage = await run([list(ids)], req, "messages", http)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": req.model, "usage": usage,
            "choices": [{"index": i, "message": {"role": "assistant", "content": o["text"]},
                         "finish_reason": _finish(o["meta_info"])} for i, o in enumerate(outs)],
        }

    return router
