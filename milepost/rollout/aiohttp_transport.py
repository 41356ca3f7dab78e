"""httpx's client API over aiohttp's connection pool, for the engine client's traffic.

httpcore's pool does work quadratic in its open connections each time a request enters or leaves
it: a rollout's 256 concurrent /generate requests to one engine cost ~2 s of client CPU (8 ms a
request, on the trainer's rank 0) where aiohttp spends ~0.1 s (`benchmarks/rollout_client.py`).
`EngineClient` keeps httpx's API (timeouts, exceptions, MockTransport in tests); this transport
moves the bytes, and turns aiohttp's errors into the httpx errors the client already maps
(refused -> ConnectError, no answer in time -> ReadTimeout, cut off -> RemoteProtocolError /
ReadError), so messages stay what users know.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import aiohttp
import httpx


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One aiohttp session, made on first use in the running loop (a client lives in one loop),
    with no connection limit: callers bound their own concurrency."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl if self._ssl is not None else True)
            # bytes are handed to httpx as they came: httpx decodes Content-Encoding itself
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        timeout = request.extensions.get("timeout", {})
        body = await request.aread()
        try:
            resp = await self._session.request(
                request.method, str(request.url), headers=list(request.headers.multi_items()),
                data=body or None, allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout.get("connect"),
                                              sock_read=timeout.get("read")))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx_error(e, request) from e
        return httpx.Response(resp.status, headers=resp.raw_headers, stream=_Body(resp, request),
                              request=request, extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class _Body(httpx.AsyncByteStream):
    def __init__(self, resp: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._resp = resp
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise as_httpx_error(e, self._request) from e

    async def aclose(self) -> None:
        if self._resp.content.at_eof():
            self._resp.release()  # read to the end: the connection goes back to the pool
        else:
            self._resp.close()  # left early (a stream given up): the connection is dropped


def as_httpx_error(e: BaseException, request: httpx.Request) -> httpx.TransportError:
    """The httpx error for an aiohttp failure (checked most specific first)."""
    message = str(e) or type(e).__name__
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(e, asyncio.TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return httpx.ReadTimeout(message, request=request)
    if isinstance(e, aiohttp.ClientConnectorError):  # refused, unreachable, name not found
        return httpx.ConnectError(message, request=request)
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return httpx.RemoteProtocolError(message or "server disconnected", request=request)
    if isinstance(e, (aiohttp.ClientPayloadError, aiohttp.ClientOSError)):
        return httpx.ReadError(message, request=request)
    return httpx.TransportError(message, request=request)
