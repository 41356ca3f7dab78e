"""The HTTP server: SGLang's endpoints over the embedded engine (FastAPI + uvicorn).

Request handlers validate and tokenize, then hand requests to the engine thread and await its
output events. Anything that changes model state (weights, pause, cache) runs on the engine thread
between steps via `Engine.call`; receiving weights over a process group happens off that thread,
so generation keeps going until the new weights are ready to be copied in. Client errors answer
400 with `{"error": {"message": ...}}` naming the field at fault, as SGLang does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from milepost.engine.engine import Engine
from milepost.engine.protocol import (
    AbortReqInput,
    GenerateReqInput,
    PauseGenerationReqInput,
    describe_validation_errors,
)
from milepost.engine.request import Request, RequestOutput
from milepost.engine.sampling import SamplingParams
from milepost.engine.stats import prometheus_text

log = logging.getLogger(__name__)


class BadRequest(Exception):
    """Client error: answered 400 with the message."""


class EngineDown(Exception):
    """The engine loop has stopped: answered 503 (as /health is) instead of waiting forever."""


@dataclass(frozen=True)
class Names:
    """What the client called each input, so that error messages name the field it sent."""

    prompt: str = "input_ids"
    max_new_tokens: str = "sampling_params.max_new_tokens"
    stop_token_ids: str = "sampling_params.stop_token_ids"
    seed: str = "sampling_params.sampling_seed"


SGLANG_NAMES = Names()
OPENAI_NAMES = Names(prompt="prompt", max_new_tokens="max_tokens", stop_token_ids="stop_token_ids",
                     seed="seed")

# How often a non-streaming request checks that its client is still there (SGLang does the same).
DISCONNECT_POLL_S = 1.0


@dataclass
class ServerInfo:
    model_path: str
    tokenizer_path: str | None
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    server_args: dict = field(default_factory=dict)


@dataclass
class _Result:
    """Accumulates a request's output events into SGLang's response."""

    rid: str
    params: SamplingParams
    return_logprob: bool
    return_text_in_logprobs: bool
    start: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        self.output_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.top_logprobs += out.new_top_logprobs
        self.versions += out.new_weight_versions
        self.last = out

    def response(self, tokenizer: object | None) -> dict:
        out = self.last
        assert out is not None
        text = ""
        if tokenizer is not None:
            text = tokenizer.decode(self.output_ids, skip_special_tokens=self.params.skip_special_tokens)
            matched = (out.finish_reason or {}).get("matched")
            if isinstance(matched, str) and not self.params.no_stop_trim and matched in text:
                text = text[: text.index(matched)]
        meta: dict = {
            "id": self.rid,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": out.cached_tokens,
            "weight_version": out.weight_version,
            "output_token_weight_versions": self.versions,
            "e2e_latency": time.perf_counter() - self.start,
        }
        if self.return_logprob:
            def tok_text(t: int) -> str | None:
                if self.return_text_in_logprobs and tokenizer is not None:
                    return tokenizer.decode([t])
                return None

            meta["output_token_logprobs"] = [
                [lp, t, tok_text(t)] for lp, t in zip(self.logprobs, self.output_ids)
            ]
            if self.top_logprobs:
                meta["output_top_logprobs"] = [
                    [[lp, t, tok_text(t)] for lp, t in row] for row in self.top_logprobs
                ]
        if out.routed_experts is not None:
            meta["routed_experts"] = out.routed_experts
        return {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}


class GenerateService:
    """Validates, tokenizes and submits generation requests; shared by SGLang and OpenAI routes."""

    def __init__(self, engine: Engine, info: ServerInfo, tokenizer: object | None) -> None:
        self.engine = engine
        self.info = info
        self.tokenizer = tokenizer
        self.max_blocks = engine.cfg.num_blocks
        self.active: set[str] = set()  # rids submitted and not yet finished, for abort by prefix

    def tokenize(self, prompt: str | list[int], field: str = "text") -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequest(f"{field}: this model has no tokenizer; send input_ids instead")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def check(self, ids: list[int], params: SamplingParams, names: Names = SGLANG_NAMES) -> None:
        """Refuse what the engine cannot serve, naming the input at fault as the client sent it."""
        vocab = self.info.vocab_size
        if not ids:
            raise BadRequest(f"{names.prompt}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{names.prompt}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        # The engine bans stop ids by indexing the logits (min_new_tokens): an id outside the
        # vocabulary would crash its loop, a negative one would ban the wrong token.
        bad = [t for t in params.stop_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"{names.stop_token_ids}: token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        seed = params.sampling_seed
        if seed is not None and not (-(2**63) <= seed and seed + params.n - 1 < 2**64):
            raise BadRequest(f"{names.seed}: {seed} (plus n-1) does not fit a 64-bit seed")
        total = len(ids) + params.max_new_tokens
        max_name = names.max_new_tokens.rsplit(".", 1)[-1]
        if total > self.info.context_length:
            raise BadRequest(
                f"{names.max_new_tokens}: prompt ({len(ids)} tokens) + {max_name} "
                f"({params.max_new_tokens}) exceeds the context length {self.info.context_length}"
            )
        need = -(-total // self.engine.cfg.block_size)
        if need > self.max_blocks:
            raise BadRequest(
                f"{names.max_new_tokens}: prompt + {max_name} need {need} KV blocks but the pool "
                f"has {self.max_blocks}; lower it or start the server with a larger --max-total-tokens"
            )

    def expand(self, body: GenerateReqInput, names: Names | None = None,
               ) -> list[tuple[list[int], SamplingParams, str]]:
        """One entry per sequence to generate (prompts x n), validated; rids made unique.

        `names` name the inputs in messages (default: SGLang's, the prompt indexed in a batch).
        A rid already running, or given twice, is refused (SGLang refuses duplicate rids too).
        """
        try:
            items = body.items()
        except ValueError as e:
            raise BadRequest(str(e)) from e
        if self.engine.error is not None:
            raise EngineDown(f"the engine stopped: {self.engine.error}")
        out = []
        for i, (prompt, params, rid) in enumerate(items):
            where = names or replace(SGLANG_NAMES,
                                     prompt="text" if body.text is not None else "input_ids")
            if body.is_batch:
                where = replace(where, prompt=f"{where.prompt}[{i}]")
            ids = self.tokenize(prompt, where.prompt)
            self.check(ids, params, where)
            base = rid or uuid.uuid4().hex
            for j in range(params.n):
                seed = None if params.sampling_seed is None else params.sampling_seed + j
                one = params.model_copy(update={"n": 1, "sampling_seed": seed})
                out.append((ids, one, base if params.n == 1 else f"{base}-{j}"))
        rids = [r for _, _, r in out]
        taken = next((r for r in rids if r in self.active), None)
        if taken is not None:
            raise BadRequest(f"rid: a request with rid {taken!r} is already running")
        if len(set(rids)) != len(rids):
            raise BadRequest("rid: the rids of a batch must be unique")
        return out

    def abort(self, rid: str) -> None:
        """Abort every request whose rid starts with `rid` (SGLang's rule: it also reaches the
        `rid-j` samples of an n>1 request)."""
        for r in [r for r in self.active if r.startswith(rid)] or [rid]:
            self.engine.abort(r)

    def submit(self, ids: list[int], params: SamplingParams, rid: str, *, return_logprob: bool,
               top_logprobs_num: int, return_routed_experts: bool, stream: bool,
               ) -> asyncio.Queue[RequestOutput]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        stop_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids.update(self.info.eos_token_ids)
        self.engine.submit(
            Request(
                rid=rid, prompt_ids=ids, params=params,
                on_output=lambda o: loop.call_soon_threadsafe(q.put_nowait, o),
                stop_ids=frozenset(stop_ids), return_logprob=return_logprob or top_logprobs_num > 0,
                top_logprobs_num=top_logprobs_num, return_routed_experts=return_routed_experts,
                stream=stream,
            )
        )
        return q

    def _start(self, ids: list[int], params: SamplingParams, rid: str, body: GenerateReqInput,
               stream: bool) -> tuple[_Result, asyncio.Queue[RequestOutput]]:
        """Submit one sequence of a /generate body; its accumulator and output queue."""
        result = _Result(rid, params, body.return_logprob or body.top_logprobs_num > 0,
                         body.return_text_in_logprobs)
        q = self.submit(ids, params, rid, return_logprob=result.return_logprob,
                        top_logprobs_num=body.top_logprobs_num,
                        return_routed_experts=body.return_routed_experts, stream=stream)
        return result, q

    async def run(self, ids: list[int], params: SamplingParams, rid: str, body: GenerateReqInput,
                  disconnected: Callable[[], Awaitable[bool]] | None = None) -> dict:
        """Generate one sequence; if `disconnected()` turns true (the client left), abort it."""
        result, q = self._start(ids, params, rid, body, stream=False)
        self.active.add(rid)
        try:
            while result.last is None or not result.last.finished:
                if disconnected is None:
                    result.add(await q.get())
                    continue
                try:
                    result.add(await asyncio.wait_for(q.get(), DISCONNECT_POLL_S))
                except asyncio.TimeoutError:
                    if await disconnected():  # the engine answers with an abort event, then we end
                        self.engine.abort(rid, "client disconnected")
        except asyncio.CancelledError:  # client went away: free the engine's work
            self.engine.abort(rid, "client disconnected")
            raise
        finally:
            self.active.discard(rid)
        return result.response(self.tokenizer)

    async def stream(self, ids: list[int], params: SamplingParams, rid: str,
                     body: GenerateReqInput) -> AsyncIterator[bytes]:
        result, q = self._start(ids, params, rid, body, stream=True)
        self.active.add(rid)
        try:
            while result.last is None or not result.last.finished:
                result.add(await q.get())
                yield b"data: " + json.dumps(result.response(self.tokenizer)).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            self.active.discard(rid)
            if result.last is None or not result.last.finished:
                self.engine.abort(rid, "client disconnected")


def create_app(engine: Engine, info: ServerInfo, tokenizer: object | None) -> FastAPI:
    from milepost.engine.memory import MemoryGuard, MemoryOccupation, memory_router
    from milepost.engine.openai_api import openai_router
    from milepost.engine.weight_check import weight_check_router
    from milepost.engine.weight_delta_routes import weight_delta_router
    from milepost.engine.weight_routes import weight_router

    app = FastAPI(title="milepost engine", version="0.1.0")
    service = GenerateService(engine, info, tokenizer)
    app.state.service = service
    gauges = _Gauges(engine)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return _error(describe_validation_errors(list(exc.errors())))

    @app.exception_handler(ValidationError)  # a model built inside a handler (OpenAI -> SGLang)
    async def _invalid_inner(_: HttpRequest, exc: ValidationError) -> JSONResponse:
        return _error(describe_validation_errors(exc.errors()))

    @app.exception_handler(BadRequest)
    async def _bad(_: HttpRequest, exc: BadRequest) -> JSONResponse:
        return _error(str(exc))

    @app.exception_handler(EngineDown)
    async def _down(_: HttpRequest, exc: EngineDown) -> JSONResponse:
        return _error(str(exc), status=503)

    @app.post("/generate")
    async def generate(body: GenerateReqInput, http: HttpRequest) -> Response:
        seqs = service.expand(body)
        if body.stream:
            if len(seqs) != 1:
                raise BadRequest("stream: streaming supports one prompt with n=1")
            return StreamingResponse(service.stream(*seqs[0], body), media_type="text/event-stream")
        results = await asyncio.gather(
            *(service.run(*s, body, http.is_disconnected) for s in seqs))
        single = not body.is_batch and len(seqs) == 1
        return JSONResponse(results[0] if single else list(results))

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse(status_code=503, content={"error": {"message": str(engine.error)}})
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        body = GenerateReqInput(input_ids=[0], sampling_params=params)
        await asyncio.wait_for(service.run([0], params, f"health-{uuid.uuid4().hex}", body), 60)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": info.model_path, "tokenizer_path": info.tokenizer_path,
                "is_generation": True, "weight_version": engine.weight_version,
                "context_length": info.context_length, "vocab_size": info.vocab_size}

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {**info.server_args, "weight_version": engine.weight_version,
                "paused": engine.paused, **await gauges.read()}

    @app.get("/get_weight_version")
    async def weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await asyncio.wrap_future(engine.call(engine.flush_cache)):
            return Response("Cache flushed.\n", status_code=200)
        return _error("cannot flush the cache while requests are queued or running")

    @app.post("/abort_request")
    async def abort_request(body: AbortReqInput) -> Response:
        if not body.abort_all and not body.rid:
            raise BadRequest("rid: give the rid of the request to abort, or abort_all=true")
        if body.abort_all:
            engine.abort(None)
        else:
            service.abort(body.rid)
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause(body: PauseGenerationReqInput) -> dict:
        await asyncio.wrap_future(engine.call(lambda: engine.pause(body.mode)))
        return {"success": True, "message": f"paused ({body.mode})"}

    @app.post("/continue_generation")
    async def resume() -> dict:
        await asyncio.wrap_future(engine.call(engine.resume))
        return {"success": True, "message": "generation continues"}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = prometheus_text(engine.stats, await gauges.read())
        return Response(body, media_type="text/plain; version=0.0.4")

    app.include_router(weight_router(engine))
    app.include_router(weight_check_router(engine))
    app.include_router(weight_delta_router(engine))
    app.include_router(openai_router(service))
    memory = MemoryOccupation(engine)  # release/resume for colocated runs (memory.py)
    app.include_router(memory_router(engine, memory))
    app.add_middleware(MemoryGuard, memory=memory)
    return app


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message}})


class _Gauges:
    """SGLang's gauges for /metrics and /get_server_info.

    KV usage walks the prefix tree, so it is read on the engine thread between steps. If that
    thread is busy for long (a weight load runs there), monitoring does not wait: the queue
    counts, safe to read from any thread, are fresh and the KV figures are the last known.
    As in SGLang, token_usage counts the KV that requests hold: prefix-cache blocks that
    eviction could free are available, not used.
    """

    WAIT_S = 0.5

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.used_blocks = 0

    async def read(self) -> dict[str, float]:
        if self.engine.error is None:  # else the loop is gone and nothing changes any more
            fut = self.engine.call(self._count_used)
            try:
                await asyncio.wait_for(asyncio.wrap_future(fut), self.WAIT_S)
            except asyncio.TimeoutError:
                pass  # cancelling the future makes the engine skip it
        else:
            self._count_used()
        e = self.engine
        blocks, size = e.pool.num_blocks, e.cfg.block_size
        return {
            "num_running_reqs": len(e.scheduler.running),
            "num_queue_reqs": len(e.scheduler.waiting),
            "num_used_tokens": self.used_blocks * size,
            "max_total_num_tokens": blocks * size,
            "token_usage": self.used_blocks / blocks,
            "num_preemptions": e.scheduler.num_preemptions,
            "cache_hit_rate": e.stats.cache_hit_rate,
        }

    def _count_used(self) -> None:
        cache = self.engine.cache
        self.used_blocks = self.engine.pool.num_used - (cache.num_evictable() if cache else 0)


def run_server(args: object) -> None:
    """`milepost serve`: load the model, start the engine thread, serve HTTP until interrupted."""
    import uvicorn

    from milepost.engine.setup import build_engine

    args = args.resolved()
    engine, info, tokenizer = build_engine(args)
    engine.start()
    try:
        app = create_app(engine, info, tokenizer)
        log.info("serving %s on http://%s:%d", info.model_path, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
