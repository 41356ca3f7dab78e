"""Checks on raw request bodies before any route sees them (an ASGI middleware).

A body over the size limit of its route is answered 413 without being parsed; a JSON body whose
strings hold a lone UTF-16 surrogate (`"\\ud800"`: valid JSON, but not Unicode text) is answered
400 naming the field, on every route: such a string once reached the weight version and made every
later response fail to encode. The common body (no `\\u` escape) costs one substring search.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


class BodyGuard:
    """`limited` routes (path prefixes) get `max_bytes`; every route gets the UTF-8 check."""

    def __init__(self, app: ASGIApp, max_bytes: int, limited: tuple[str, ...]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.limited = limited

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes if scope["path"].startswith(self.limited) else None
        declared = _content_length(scope)
        if limit is not None and declared is not None and declared > limit:
            await _answer(send, 413, _too_large(declared, limit))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if limit is not None and size > limit:
                await _answer(send, 413, _too_large(size, limit))
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = surrogate_problem(body)
        if problem is not None:
            await _answer(send, 400, problem)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: the client's disconnect

        await self.app(scope, replay, send)


def surrogate_problem(body: bytes) -> str | None:
    """A message naming the first string with a lone surrogate, or None when there is none."""
    if b"\\u" not in body or not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None  # not JSON: the route's own parsing answers it
    path = _find_surrogate(value, "")
    if path is None:
        return None  # only well-formed pairs
    return (f"{path or 'body'}: the string holds a lone UTF-16 surrogate (e.g. \\ud800), which is "
            "not valid Unicode text; send valid UTF-8")


def _find_surrogate(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _find_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for k, v in value.items():
            key_path = f"{path}.{k}" if path else k
            if _find_surrogate(k, key_path) is not None:
                return (path or "body") + " (a key)"
            found = _find_surrogate(v, key_path)
            if found is not None:
                return found
    return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(size: int, limit: int) -> str:
    return (f"body: {size} bytes is over this server's limit of {limit} bytes for the route "
            "(--max-request-body-mb); split the request")


async def _answer(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
