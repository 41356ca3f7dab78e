"""API-key authentication of milepost's HTTP servers (SGLang's `--api-key`), and exposure warnings.

A server given a key answers 401 to every request without `Authorization: Bearer <key>`, except
`GET /health` (launchers and load balancers probe it; it says nothing but "up"). The key is
compared in constant time. milepost's own clients (rollout, weight transports, checks) send the
key that the trainer rank was given (`use_api_key`, set once at start from the run config);
OpenAI-style agents send it as their `api_key`. Servers bind 127.0.0.1 by default; binding any
other address without a key logs a warning, since every endpoint (weight updates included) is
then open to whoever can reach the port.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
_client_key: list[str | None] = [None]  # set by use_api_key at a process's start, never at import


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; False for anything else (other names included)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, api_key: str | None, what: str,
                    logger: logging.Logger | None = None) -> bool:
    """Log a warning when `what` binds a non-loopback `host` without an api key; True if so."""
    if api_key or is_loopback(host):
        return False
    (logger or logging.getLogger(__name__)).warning(
        "%s binds %s without --api-key: anyone who can reach this port can generate, read and "
        "replace the model's weights. Bind 127.0.0.1, or pass --api-key KEY and send "
        "'Authorization: Bearer KEY'", what, host)
    return True


class ApiKeyMiddleware:
    """ASGI middleware: 401 unless the request carries `Authorization: Bearer <api_key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("ApiKeyMiddleware needs a non-empty api_key")
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        why = "wrong api key" if given else "no api key"
        body = json.dumps({"error": {"message": f"unauthorized ({why}): this server was started "
                                     "with --api-key; send 'Authorization: Bearer <key>'"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def protect(app: Any, api_key: str | None) -> None:
    """Require `api_key` on every route of the FastAPI/Starlette `app` but /health (no-op if None).

    Call after the app's other middleware is added: the last added runs first, so a request
    without the key is refused before anything reads its body.
    """
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)


def use_api_key(api_key: str | None) -> None:
    """The key this process's milepost clients send to engines, router and session server."""
    _client_key[0] = api_key or None


def client_headers() -> dict[str, str]:
    """Headers for a milepost client: the Authorization header when `use_api_key` set a key."""
    key = _client_key[0]
    return {"Authorization": f"Bearer {key}"} if key else {}
