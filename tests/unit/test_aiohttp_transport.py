"""The engine client's aiohttp transport against a real loopback socket server that answers,
streams, hangs, hangs up or is not there: each failure is the httpx error EngineClient maps
(so its messages say refused / timed out / cut off), and an answer's bytes arrive whole."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest

from milepost.rollout.aiohttp_transport import AiohttpTransport
from milepost.rollout.client import EngineClient
from milepost.rollout.engine_output import EngineUnavailableError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return await reader.readexactly(length)


async def _json_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:  # keep-alive: several requests on one connection
        try:
            body = await _read_request(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()


async def _chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for part in (b"data: 1\n\n", b"data: 2\n\n"):
        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        await writer.drain()
        await asyncio.sleep(0.05)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    await asyncio.sleep(30)


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.close()


async def _cut_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial\":")
    await writer.drain()
    writer.close()


async def _serve(handler: Handler, use: Callable[[str], Awaitable[None]]) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await use(f"http://127.0.0.1:{port}")
    finally:
        server.close()


def _client(url: str, timeout_s: float = 10.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=timeout_s, transport=AiohttpTransport())


def test_many_concurrent_json_answers_arrive_whole() -> None:
    async def use(url: str) -> None:
        async with _client(url) as c:
            answers = await asyncio.gather(*(c.post("/x", json={"i": i, "pad": "y" * 5000})
                                             for i in range(300)))
        assert [r.json()["i"] for r in answers] == list(range(300))
        assert all(r.status_code == 200 and len(r.json()["pad"]) == 5000 for r in answers)

    asyncio.run(_serve(_json_echo, use))


def test_a_chunked_stream_arrives_in_order() -> None:
    async def use(url: str) -> None:
        async with _client(url) as c, c.stream("POST", "/s", json={}) as r:
            text = b"".join([chunk async for chunk in r.aiter_bytes()])
        assert text == b"data: 1\n\ndata: 2\n\n"

    asyncio.run(_serve(_chunked, use))


@pytest.mark.parametrize(("handler", "error"), [
    (_silent, httpx.ReadTimeout), (_hang_up, httpx.RemoteProtocolError), (_cut_body, httpx.ReadError),
], ids=["no-answer", "hang-up", "cut-body"])
def test_failures_become_the_httpx_errors_the_client_maps(handler: Handler, error: type) -> None:
    async def use(url: str) -> None:
        async with _client(url, timeout_s=0.5) as c:
            with pytest.raises(error):
                r = await c.post("/x", json={})
                await r.aread()

    asyncio.run(_serve(handler, use))


def test_a_refused_connection_is_a_connect_error_named_by_the_engine_client() -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"

        async def use() -> None:
            async with EngineClient(url, 5.0, generate_retries=0) as c:
                with pytest.raises(EngineUnavailableError, match="ConnectError"):
                    await c.generate([1, 2], {"max_new_tokens": 1})

        asyncio.run(use())


def test_a_silent_engine_times_out_through_the_engine_client() -> None:
    async def use(url: str) -> None:
        async with EngineClient(url, 0.5, generate_retries=0) as c:
            with pytest.raises(EngineUnavailableError, match="timed out"):
                await c.generate([1, 2], {"max_new_tokens": 1})

    asyncio.run(_serve(_silent, use))
