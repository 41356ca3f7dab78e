"""The TITO session server over HTTP (report 2.4): an OpenAI-compatible chat endpoint per session.

    POST   /sessions                               -> {"session_id"}
    POST   /sessions/{id}/v1/chat/completions      OpenAI chat (messages, tools, tool_calls,
                                                   reasoning_content, stream)
    GET    /sessions/{id}                          turns, leaves, stored messages
    DELETE /sessions/{id}
    POST   /sessions/{id}/samples                  {"leaves": [ids] | null} -> training samples
                                                   (null: the server's leaf selection)

Point an agent's `base_url` at `{server}/sessions/{id}/v1`. Token fields a client sends (e.g.
`prompt_token_ids`) are ignored: the server owns tokenization. `stream: true` answers in
server-sent-event chunks token by token as the engine generates (openai_chat.py: what is sent
when, and what happens to a turn whose client leaves mid-stream).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from milepost.rollout.client import EngineRequestError, EngineUnavailableError
from milepost.session.divergence import HEADER
from milepost.session.families import FamilyError
from milepost.session.openai_chat import completion, divergence_headers, stream_turn
from milepost.session.render import RenderError
from milepost.session.selection import LeafSelectionError
from milepost.session.service import GenerationAborted, SessionNotFound, SessionService
from milepost.session.store import SessionConflict


class ToolFunction(BaseModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: ToolFunction


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # client-side additions (refusal, audio, ...)
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "assistant" and (self.tool_calls or self.reasoning_content):
            raise ValueError(f"a {self.role} message cannot carry tool_calls or reasoning_content")
        if self.role in ("user", "system") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        for call in d.get("tool_calls") or []:
            args = call["function"]["arguments"]
            if not isinstance(args, str):
                call["function"]["arguments"] = json.dumps(args, ensure_ascii=False)
        return d


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # token fields and unused OpenAI options
    model: str = "default"
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Passed to the engine's sampling (SGLang names); under the run's enforced sampling (RL) the
    # run's values win, as for temperature.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, allow_inf_nan=False)
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Honoured at their no-op values only (refused otherwise, naming the field): the session
    # server has no constrained decoding.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # Extra variables of the chat template for this turn (e.g. enable_thinking for Qwen3).
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        bad = _non_utf8(data, "")
        if bad is not None:
            raise ValueError(f"{bad or 'body'}: a string is not valid UTF-8 (a lone surrogate); "
                             f"send text as UTF-8")
        return data

    @model_validator(mode="after")
    def _last(self) -> ChatRequest:
        if self.messages[-1].role == "assistant":
            raise ValueError("messages: the last message is the assistant's; a turn asks the "
                             "model to answer a user, tool or system message")
        return self

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        if self.tool_choice not in (None, "auto"):
            raise ValueError(f"tool_choice {self.tool_choice!r}: the session server cannot force "
                             f"or forbid tool calls (no constrained decoding); leave it unset or "
                             f"'auto'")
        if self.parallel_tool_calls is False:
            raise ValueError("parallel_tool_calls false: the session server cannot stop the "
                             "model from writing several calls; leave it unset or true")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError(f"response_format {self.response_format!r}: structured output is "
                             f"not supported by the session server; use {{'type': 'text'}}")
        if self.top_logprobs:
            raise ValueError("top_logprobs: the session server returns the sampled token's "
                             "log-prob only (logprobs: true); leave top_logprobs unset or 0")
        if self.logprobs and self.stream:
            raise ValueError("logprobs with stream: log-probs come with non-streamed answers "
                             "only; drop one of them")
        reserved = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template",
                    "documents", "continue_final_message"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise ValueError(f"chat_template_kwargs: {sorted(reserved)} are set by the session "
                             f"server itself")
        return self

    def sampling(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_completion_tokens or self.max_tokens,
                "temperature": self.temperature, "top_p": self.top_p,
                "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
                "top_k": self.top_k, "min_p": self.min_p,
                "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty,
                "repetition_penalty": self.repetition_penalty, "sampling_seed": self.seed}


def _non_utf8(value: Any, where: str) -> str | None:
    """The path of the first string in `value` that cannot be encoded as UTF-8, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for k, v in items:
        found = _non_utf8(k, where) if isinstance(k, str) else None
        found = found if found is not None else _non_utf8(v, f"{where}.{k}" if where else str(k))
        if found is not None:
            return found
    return None


class SamplesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    leaves: list[int] | None = None


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status)


def build_app(service: SessionService) -> FastAPI:
    app = FastAPI(title="milepost session server")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
                 for e in exc.errors()]
        return _error(400, "; ".join(parts), "invalid_request_error")

    @app.exception_handler(SessionNotFound)
    async def _unknown(_: Request, exc: SessionNotFound) -> JSONResponse:
        return _error(404, str(exc.args[0]), "not_found")

    @app.exception_handler(SessionConflict)
    async def _conflict(_: Request, exc: SessionConflict) -> JSONResponse:
        response = _error(409, str(exc), "session_conflict")
        if exc.divergence is not None:  # the structured record too (docs/sessions.md)
            body = json.loads(response.body)
            body["error"]["divergence"] = exc.divergence.to_dict()
            response = JSONResponse(body, 409, headers={HEADER: exc.divergence.header()})
        return response

    @app.exception_handler(RenderError)
    async def _render(_: Request, exc: RenderError) -> JSONResponse:
        return _error(422, str(exc), "template_error")

    @app.exception_handler(FamilyError)
    async def _family(_: Request, exc: FamilyError) -> JSONResponse:
        return _error(422, str(exc), "template_error")

    @app.exception_handler(EngineRequestError)
    async def _engine_refused(_: Request, exc: EngineRequestError) -> JSONResponse:
        return _error(400, f"the engine refused the turn: {exc.message}", "invalid_request_error")

    @app.exception_handler(EngineUnavailableError)
    async def _engine_gone(_: Request, exc: EngineUnavailableError) -> JSONResponse:
        return _error(503, f"the engine is unavailable: {exc}", "engine_unavailable")

    @app.exception_handler(LeafSelectionError)
    async def _selector(_: Request, exc: LeafSelectionError) -> JSONResponse:
        return _error(500, str(exc), "leaf_selection_error")

    @app.exception_handler(GenerationAborted)
    async def _aborted(_: Request, exc: GenerationAborted) -> JSONResponse:
        return _error(503, str(exc), "aborted")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "sessions": len(service.sessions)}

    @app.post("/sessions")
    async def create() -> dict:
        return {"session_id": service.create().id, "mode": service.settings.mode}

    @app.get("/sessions/{session_id}")
    async def show(session_id: str) -> dict:
        # pending_turns: prepared and neither stored nor dropped yet (e.g. streaming now)
        return {**service.get(session_id).summary(),
                "pending_turns": service.pending.get(session_id, 0)}

    @app.delete("/sessions/{session_id}")
    async def delete(session_id: str) -> dict:
        service.delete(session_id)
        return {"deleted": session_id}

    @app.post("/sessions/{session_id}/samples")
    async def samples(session_id: str, req: SamplesRequest | None = None) -> dict:
        got = service.samples(session_id, req.leaves if req is not None else None)
        return {"samples": [s.to_dict() for s in got]}

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat(session_id: str, req: ChatRequest) -> Any:
        turn = await service.prepare(session_id, [m.as_dict() for m in req.messages], req.tools,
                                     req.sampling(), req.chat_template_kwargs)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return await stream_turn(service, turn, req.model, cid, usage)
        headers = divergence_headers(turn)
        return JSONResponse(completion(await service.run(turn), req.model, cid,
                                       service.renderer if req.logprobs else None),
                            headers=headers)

    return app
