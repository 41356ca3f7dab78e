"""OpenAI-compatible basics: `/v1/completions` and `/v1/chat/completions` (non-streaming).

They run on the same GenerateService as `/generate`; chat prompts are rendered with the
checkpoint's own chat template. Tools and streaming for agents live in the session server.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from milepost.engine.protocol import GenerateReqInput
from milepost.engine.sampling import SamplingParams


class _OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore")  # clients send many optional fields we do not use

    model: str = "default"
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_tokens if self.max_tokens is not None else 128,
            temperature=self.temperature, top_p=self.top_p, n=self.n, stop=self.stop,
            sampling_seed=self.seed,
        )


class CompletionRequest(_OpenAIBase):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatCompletionRequest(_OpenAIBase):
    messages: list[ChatMessage] = Field(min_length=1)


def _finish(meta: dict) -> str:
    return "length" if meta["finish_reason"]["type"] == "length" else "stop"


def openai_router(service: object) -> APIRouter:
    from milepost.engine.server import BadRequest, GenerateService

    assert isinstance(service, GenerateService)
    router = APIRouter()

    async def run(ids: list[int], req: _OpenAIBase) -> tuple[list[dict], dict]:
        if req.stream:
            raise BadRequest("stream: streaming is not supported on /v1 endpoints; use /generate")
        params = req.sampling()
        body = GenerateReqInput(input_ids=ids, sampling_params=params)
        seqs = service.expand(body)
        outs = await asyncio.gather(*(service.run(*s, body) for s in seqs))
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return outs, usage

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict:
        outs, usage = await run(service.tokenize(req.prompt), req)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": req.model, "usage": usage,
            "choices": [{"index": i, "text": o["text"], "finish_reason": _finish(o["meta_info"]),
                         "logprobs": None} for i, o in enumerate(outs)],
        }

    @router.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> dict:
        if service.tokenizer is None or not getattr(service.tokenizer, "chat_template", None):
            raise BadRequest("messages: this model has no chat template; use /v1/completions")
        ids = service.tokenizer.apply_chat_template(
            [m.model_dump(exclude_none=True) for m in req.messages],
            add_generation_prompt=True, tokenize=True, return_dict=False,
        )
        outs, usage = await run(list(ids), req)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": req.model, "usage": usage,
            "choices": [{"index": i, "message": {"role": "assistant", "content": o["text"]},
                         "finish_reason": _finish(o["meta_info"])} for i, o in enumerate(outs)],
        }

    return router
