"""HTTP client of an engine speaking SGLang's protocol (a real SGLang server or `milepost serve`).

`EngineClient` is async (httpx's API, aiohttp's connections); `SyncEngineClient` offers the
same calls to synchronous code.
What the engine answers (outputs, errors by what a caller can do about them) is read by
`engine_output.py`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Literal, TypeVar

import httpx

from milepost.auth import client_headers
from milepost.http_tls import tls_context
from milepost.rollout.aiohttp_transport import AiohttpTransport
from milepost.rollout.engine_output import (  # re-exported: callers import them from here
    EngineError,
    EngineProtocolError,
    EngineRequestError,
    EngineUnavailableError,
    GenerateOutput,
    _error_message,
    parse_generate,
)

log = logging.getLogger(__name__)

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's session affinity header
PauseMode = Literal["abort", "retract", "in_place"]



class EngineClient:
    """Async client of one engine (or a router in front of several).

    timeout_s: per request (connect, read, write). generate_retries / retry_backoff_s: how many
    times `generate` retries on EngineUnavailableError, waiting backoff * 2**attempt between tries.
    transport: an httpx transport to use instead of the network (tests).
    Use `async with EngineClient(url) as c:` or call `aclose()`.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, *, generate_retries: int = 2,
                 retry_backoff_s: float = 0.5,
                 transport: httpx.AsyncBaseTransport | None = None,
                 require_routing_key: bool = False, lora_path: str | None = None) -> None:
        if generate_retries < 0:
            raise ValueError(f"generate_retries must be >= 0, got {generate_retries}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.generate_retries = generate_retries
        self.retry_backoff_s = retry_backoff_s
        # Session affinity (report 2.1): a generate without a key would be load-routed and lose
        # the session's prefix cache silently, so it is an error instead.
        self.require_routing_key = require_routing_key
        self.lora_path = lora_path  # the LoRA adapter every generate names (SGLang's lora_path)
        # aiohttp moves the bytes (httpcore's pool costs CPU quadratic in concurrent requests),
        # with no connection limit: callers bound their own concurrency (rollout's
        # max_concurrency), and a pool limit would only turn waiting into spurious timeouts.
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout_s, headers=client_headers(),
            transport=transport if transport is not None else AiohttpTransport(tls_context()))

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- plumbing -----------------------------------------------------------------------------

    async def _request(self, method: str, path: str, body: dict | None = None, *,
                       headers: dict[str, str] | None = None, timeout_s: float | None = None,
                       ) -> httpx.Response:
        url = f"{self.base_url}{path}"
        try:
            resp = await self._http.request(
                method, path, json=body, headers=headers,
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.TimeoutException as e:
            raise EngineUnavailableError(url, f"timed out ({type(e).__name__})") from e
        except httpx.TransportError as e:  # refused, reset, closed mid-answer
            raise EngineUnavailableError(url, f"{type(e).__name__}: {e or 'connection failed'}"
                                         ) from e
        if resp.status_code >= 500:
            raise EngineUnavailableError(url, _error_message(resp), resp.status_code)
        if resp.status_code >= 400:
            raise EngineRequestError(url, _error_message(resp), resp.status_code)
        return resp

    async def _json(self, method: str, path: str, body: dict | None = None, *,
                    timeout_s: float | None = None) -> dict[str, Any]:
        """A control call whose answer is a JSON object; `success: false` is a refusal too."""
        resp = await self._request(method, path, body, timeout_s=timeout_s)
        try:
            out = resp.json()
        except ValueError as e:
            raise EngineProtocolError(f"{self.base_url}{path}", f"answer is not JSON: "
                                      f"{resp.text[:200]!r}") from e
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineRequestError(f"{self.base_url}{path}", str(out.get("message", out)),
                                     resp.status_code)
        return out if isinstance(out, dict) else {"result": out}

    # ---- generation -----------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *,
                       return_logprob: bool = True, return_routed_experts: bool = False,
                       rid: str | None = None, routing_key: str | None = None,
                       top_logprobs_num: int = 0, lora_path: str | None = None) -> GenerateOutput:
        """One completion of `input_ids`. Retries EngineUnavailableError `generate_retries` times
        (a retry with a rid uses `rid-retryK`, so `abort_request(rid)` still reaches it).
        top_logprobs_num > 0: `meta_info["output_top_logprobs"]` holds each token's top ids.
        lora_path: this request's LoRA adapter (default: the client's)."""
        lora_path = lora_path if lora_path is not None else self.lora_path
        if self.require_routing_key and not routing_key:
            raise ValueError(f"generate on {self.base_url}: this client requires a routing key "
                             f"({ROUTING_KEY_HEADER}) on every request (session affinity); none "
                             f"was given, and load-based routing is not a fallback")
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key is not None else None
        for attempt in range(self.generate_retries + 1):
            body: dict[str, Any] = {"input_ids": list(input_ids),
                                    "sampling_params": sampling_params,
                                    "return_logprob": return_logprob}
            if return_routed_experts:
                body["return_routed_experts"] = True
            if lora_path is not None:
                body["lora_path"] = lora_path
            if top_logprobs_num:
                body["top_logprobs_num"] = top_logprobs_num
            if rid is not None:
                body["rid"] = rid if attempt == 0 else f"{rid}-retry{attempt}"
            try:
                resp = await self._request("POST", "/generate", body, headers=headers)
            except EngineUnavailableError as e:
                if attempt == self.generate_retries:
                    raise
                wait = self.retry_backoff_s * 2**attempt
                log.warning("generate on %s failed (%s); retry %d/%d in %.1f s", self.base_url,
                            e.message, attempt + 1, self.generate_retries, wait)
                await asyncio.sleep(wait)
                continue
            try:
                payload = resp.json()
            except ValueError as e:
                raise EngineProtocolError(f"{self.base_url}/generate",
                                          f"answer is not JSON: {resp.text[:200]!r}") from e
            return parse_generate(payload, f"{self.base_url}/generate", return_logprob)
        raise AssertionError("unreachable")

    async def score(self, input_ids: list[int] | str, logprob_start_len: int, *,
                    temperature: float = 1.0, top_logprobs_num: int = 0,
                    token_ids_logprob: list[int] | None = None,
                    timeout_s: float | None = None) -> dict[str, Any]:
        """Prompt log-probs of `input_ids` from position `logprob_start_len` on, generating nothing
        (`max_new_tokens: 0`): the answer's `meta_info` (`input_token_logprobs`, and
        `input_top_logprobs` / `input_token_ids_logprobs` when asked). A str is sent as `text`
        (the server tokenizes it). No retries here."""
        source = {"text": input_ids} if isinstance(input_ids, str) else {"input_ids": list(input_ids)}
        body: dict[str, Any] = {
            **source, "return_logprob": True,
            "logprob_start_len": logprob_start_len,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature}}
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        if token_ids_logprob:
            body["token_ids_logprob"] = list(token_ids_logprob)
        resp = await self._request("POST", "/generate", body, timeout_s=timeout_s)
        try:
            meta = resp.json()["meta_info"]
        except (ValueError, KeyError, TypeError) as e:
            raise EngineProtocolError(f"{self.base_url}/generate",
                                      f"scoring answer has no meta_info: {resp.text[:200]!r}") from e
        if not isinstance(meta, dict):
            raise EngineProtocolError(f"{self.base_url}/generate", "meta_info is not an object")
        return meta

    async def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any], *,
                              return_logprob: bool = True, return_routed_experts: bool = False,
                              rid: str | None = None, routing_key: str | None = None,
                              ) -> AsyncIterator[GenerateOutput]:
        """`/generate` with `stream: true`: one GenerateOutput per server-sent chunk, each
        cumulative (all output ids and log-probs so far, as SGLang sends them by default; a server
        started with `--incremental-streaming-output` is not supported). The last one carries the
        finish reason. No retries: tokens already handed out cannot be taken back. Closing the
        iterator early closes the connection, which makes the engine abort the request."""
        if self.require_routing_key and not routing_key:
            raise ValueError(f"generate_stream on {self.base_url}: this client requires a routing "
                             f"key ({ROUTING_KEY_HEADER}) on every request (session affinity)")
        url = f"{self.base_url}/generate"
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": sampling_params,
                                "return_logprob": return_logprob, "stream": True}
        if return_routed_experts:
            body["return_routed_experts"] = True
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        if rid is not None:
            body["rid"] = rid
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key is not None else None
        last: GenerateOutput | None = None
        try:
            async with self._http.stream("POST", "/generate", json=body, headers=headers) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    cls = EngineUnavailableError if resp.status_code >= 500 else EngineRequestError
                    raise cls(url, _error_message(resp), resp.status_code)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, SSE comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        payload = json.loads(data)
                    except ValueError as e:
                        raise EngineProtocolError(url, f"stream chunk is not JSON: {data[:200]!r}"
                                                  ) from e
                    if isinstance(payload, dict) and "error" in payload:
                        raise EngineRequestError(url, str(payload["error"]))
                    last = parse_generate(payload, url, return_logprob)
                    yield last
        except httpx.TimeoutException as e:
            raise EngineUnavailableError(url, f"timed out mid-stream ({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise EngineUnavailableError(url, f"{type(e).__name__}: {e or 'stream broken'}") from e
        if last is None or not last.finish_reason:
            raise EngineUnavailableError(url, "the stream ended before a finished chunk")

    # ---- health and state -----------------------------------------------------------------------

    async def health(self) -> bool:
        """True when `/health` answers 200; False when unreachable or unhealthy (never raises)."""
        try:
            await self._request("GET", "/health", timeout_s=min(self.timeout_s, 10.0))
        except EngineError:
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> None:
        """Wait until `/health` answers 200, else raise EngineUnavailableError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() > deadline:
                raise EngineUnavailableError(f"{self.base_url}/health",
                                             f"not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)

    async def get_weight_version(self) -> str:
        return str((await self._json("GET", "/get_weight_version"))["weight_version"])

    async def get_server_info(self) -> dict[str, Any]:
        return await self._json("GET", "/get_server_info")

    async def get_model_info(self) -> dict[str, Any]:
        return await self._json("GET", "/get_model_info")

    async def metrics(self) -> str:
        """The Prometheus text of `/metrics`."""
        return (await self._request("GET", "/metrics")).text

    # ---- scheduling control ---------------------------------------------------------------------

    async def flush_cache(self) -> None:
        """Drop the prefix cache; EngineRequestError while requests are running."""
        await self._request("POST", "/flush_cache")

    async def pause_generation(self, mode: PauseMode = "abort") -> dict[str, Any]:
        return await self._json("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        return await self._json("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort the request `rid` (and its `rid-*` samples and retries), or every request."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort_request: give a rid, or abort_all=True (not both)")
        body: dict[str, Any] = {"abort_all": True} if abort_all else {"rid": rid}
        await self._request("POST", "/abort_request", body)

    # ---- weights ----------------------------------------------------------------------------

    async def update_weights_from_tensor(
        self, serialized_named_tensors: list[str], *, load_format: str | None = None,
        flush_cache: bool = True, abort_all_requests: bool = False,
        weight_version: str | None = None, timeout_s: float | None = None,
    ) -> dict[str, Any]:
        return await self._json("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
            "weight_version": weight_version}, timeout_s=timeout_s)

    async def update_weights_from_disk(
        self, model_path: str, *, load_format: str | None = None, flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: str | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        return await self._json("POST", "/update_weights_from_disk", {
            "model_path": str(model_path), "load_format": load_format, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests, "weight_version": weight_version},
            timeout_s=timeout_s)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, *,
        group_name: str = "weight_update_group", backend: Literal["nccl", "gloo"] = "nccl",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Join the trainer's broadcast group. Blocks until every member has joined, so the
        trainer must join concurrently (e.g. run this call in a task, then join)."""
        return await self._json("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend}, timeout_s=timeout_s)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *,
        group_name: str = "weight_update_group", flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: str | None = None,
        load_format: str | None = None, timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Receive one bucket broadcast by the trainer; answers after the trainer has sent it."""
        return await self._json("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": [list(s) for s in shapes],
            "group_name": group_name, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests, "weight_version": weight_version,
            "load_format": load_format}, timeout_s=timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group",
                                           ) -> dict[str, Any]:
        return await self._json("POST", "/destroy_weights_update_group",
                                {"group_name": group_name})

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False,
                                    ) -> dict[str, Any]:
        return await self._json("POST", "/update_weight_version", {
            "new_version": str(new_version), "abort_all_requests": abort_all_requests})


T = TypeVar("T")

# The calls SyncEngineClient offers (every public coroutine of EngineClient).
_SYNC_CALLS = (
    "generate", "health", "wait_healthy", "get_weight_version", "get_server_info",
    "get_model_info", "metrics", "flush_cache", "pause_generation", "continue_generation",
    "abort_request", "update_weights_from_tensor", "update_weights_from_disk",
    "init_weights_update_group", "update_weights_from_distributed",
    "destroy_weights_update_group", "update_weight_version",
)


class SyncEngineClient:
    """EngineClient's calls for synchronous code: `SyncEngineClient(url).get_weight_version()`.

    The async client runs on a private event-loop thread, so this works whether or not the
    caller has an event loop of its own (the caller blocks until the answer). Close with
    `close()` or a `with` block.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"engine-client {base_url}", daemon=True)
        self._thread.start()
        self.client = self._run(self._make(base_url, timeout_s, kwargs))
        self.base_url = self.client.base_url

    @staticmethod
    async def _make(base_url: str, timeout_s: float, kwargs: dict) -> EngineClient:
        return EngineClient(base_url, timeout_s, **kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> SyncEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def _sync(name: str) -> Callable[..., Any]:
    fn = getattr(EngineClient, name)

    @functools.wraps(fn)
    def call(self: SyncEngineClient, *args: Any, **kwargs: Any) -> Any:
        return self._run(fn(self.client, *args, **kwargs))

    return call


for _call in _SYNC_CALLS:
    setattr(SyncEngineClient, _call, _sync(_call))
del _call
