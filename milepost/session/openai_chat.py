"""OpenAI chat-completion answers of a session turn: the whole completion, or a token-by-token
stream of `chat.completion.chunk` events.

A streamed turn runs in its own task that feeds a queue; the HTTP response relays the queue. The
response waits for the engine's first chunk before it starts, so a refusal by the engine is still
a 4xx/503 with a message. When the client goes away mid-stream the task is cancelled: the engine
request is aborted and the turn is dropped (nothing is stored, a linear session's lock is freed,
the harness may send the same request again). A turn whose generation finished is stored even if
the client leaves before reading the last chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from milepost.session.divergence import HEADER
from milepost.session.render import Renderer
from milepost.session.service import PreparedTurn, SessionService, TurnResult
from milepost.session.streaming import DeltaStream

_INCOMPLETE = "\ufffd"


def finish_reason(result: TurnResult) -> str:
    if result.output.finish_type == "length":
        return "length"
    return "tool_calls" if result.reply.get("tool_calls") else "stop"


def usage(result: TurnResult) -> dict[str, Any]:
    out = result.output
    return {"prompt_tokens": out.prompt_tokens or len(result.turn.ids) - len(out.output_ids),
            "completion_tokens": len(out.output_ids), "total_tokens": len(result.turn.ids),
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def milepost_info(result: TurnResult) -> dict[str, Any]:
    d = result.divergence
    return {"turn_id": result.turn.id, "weight_version": result.output.weight_version,
            "overhead_ms": result.overhead_s * 1e3, "generate_ms": result.generate_s * 1e3,
            "divergence": d.to_dict() if d is not None else None}


def completion(result: TurnResult, model: str, cid: str,
               logprobs_from: Renderer | None = None) -> dict[str, Any]:
    """The chat.completion answer; with `logprobs_from` (logprobs: true) each sampled token's
    text and the engine's log-prob, in OpenAI's `logprobs.content` shape."""
    logprobs = None
    if logprobs_from is not None:
        out = result.output
        logprobs = {"content": [
            {"token": (t := logprobs_from.decode([i])), "logprob": lp,
             "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for i, lp in zip(out.output_ids, out.logprobs)]}
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": result.reply, "finish_reason": finish_reason(result),
                     "logprobs": logprobs}],
        "usage": usage(result), "milepost": milepost_info(result),
    }


class IncrementalText:
    """The text of a growing list of output ids, decoding only a short window each time (a
    whole decode per token would cost O(n^2)). The window starts one token back, so tokenizers
    that render a token differently at the start of a text still join correctly."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # ids whose text is in self.text

    def update(self, ids: list[int]) -> str:
        before = self.decode(ids[self._prefix:self._read])
        now = self.decode(ids[self._prefix:])
        if len(now) > len(before) and not now.endswith(_INCOMPLETE):
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(ids)
        return self.text


class TurnStreamResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends (finished, client
    gone, or never started), so an abandoned turn is always cancelled."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n"


_END = object()


async def stream_turn(service: SessionService, turn: PreparedTurn, model: str, cid: str,
                      include_usage: bool) -> TurnStreamResponse:
    """Start the turn; answer once the engine produced its first chunk (errors before that
    raise here and become the handler's 4xx/503)."""
    renderer: Renderer = service.renderer
    base = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                          "logprobs": None}]})

    async def produce() -> None:
        deltas = DeltaStream(renderer.family)
        text = IncrementalText(renderer.decode)
        first = True
        try:
            async for item in service.stream(turn):
                if first:
                    queue.put_nowait(chunk({"role": "assistant", "content": ""}))
                    first = False
                if isinstance(item, TurnResult):
                    for d in deltas.finish(item.reply):
                        queue.put_nowait(chunk(d))
                    last = {**base, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                 "finish_reason": finish_reason(item)}],
                            "milepost": milepost_info(item)}
                    queue.put_nowait(_sse(last))
                    if include_usage:
                        queue.put_nowait(_sse({**base, "choices": [], "usage": usage(item)}))
                    continue
                ids = item.output_ids
                if ids and ids[-1] in renderer.eot_ids:
                    ids = ids[:-1]
                for d in deltas.update(text.update(ids)):
                    queue.put_nowait(chunk(d))
        except Exception as e:  # noqa: BLE001 - handed to the response (status, or an event)
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_END)

    task = asyncio.create_task(produce(), name=f"session-turn:{turn.session.id}")

    async def close() -> None:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        head = await queue.get()
    except BaseException:
        await close()
        raise
    if isinstance(head, Exception):
        await close()
        raise head

    async def body() -> AsyncIterator[str]:
        item = head
        while item is not _END:
            if isinstance(item, Exception):  # after the first chunk: an error event
                status, message = _describe(item)
                yield _sse({"error": {"message": message, "type": type(item).__name__,
                                      "code": status}})
                break
            yield item
            item = await queue.get()
        yield "data: [DONE]\n\n"

    return TurnStreamResponse(body(), close, divergence_headers(turn))


def divergence_headers(turn: PreparedTurn) -> dict[str, str]:
    """The divergence header of a turn that rolled back or forked (divergence.py)."""
    return {HEADER: turn.divergence.header()} if turn.divergence is not None else {}


def _describe(e: Exception) -> tuple[int, str]:
    status = getattr(e, "status", None)
    return (int(status) if isinstance(status, int) else 500), str(e)
