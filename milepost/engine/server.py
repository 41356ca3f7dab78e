"""The HTTP server: SGLang's endpoints over the embedded engine (FastAPI + uvicorn).

Request handlers validate and tokenize, then hand requests to the engine thread and await its
output events. Anything that changes model state (weights, pause, cache) runs on the engine thread
between steps via `Engine.call`; receiving weights over a process group happens off that thread,
so generation keeps going until the new weights are ready to be copied in. Client errors answer
400 with `{"error": {"message": ...}}` naming the field at fault, as SGLang does.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from milepost.engine.body_guard import BodyGuard
from milepost.engine.engine import Engine
from milepost.engine.info_routes import GENERATION_ROUTES, Gauges, info_router
from milepost.engine.generate_service import (  # noqa: F401 - re-exported for openai_api and tests
    OPENAI_NAMES,
    SGLANG_NAMES,
    BadRequest,
    EngineDown,
    GenerateService,
    Limits,
    Names,
    ServerInfo,
    TooLarge,
)
from milepost.engine.protocol import (
    AbortReqInput,
    GenerateReqInput,
    PauseGenerationReqInput,
    describe_validation_errors,
)
from milepost.engine.sampling import SamplingParams
from milepost.engine.stats import prometheus_text

log = logging.getLogger(__name__)


def create_app(engine: Engine, info: ServerInfo, tokenizer: object | None,
               limits: Limits | None = None, incremental_stream: bool = False,
               max_body_bytes: int = 128 << 20, tool_call_parser: str | None = None) -> FastAPI:
    from milepost.engine.memory import MemoryGuard, MemoryOccupation, memory_router
    from milepost.engine.openai_api import openai_router
    from milepost.engine.openai_chat import tool_call_family
    from milepost.engine.weight_check import weight_check_router
    from milepost.engine.weight_delta_routes import weight_delta_router
    from milepost.engine.weight_routes import weight_router
    from milepost.lora.routes import lora_router

    app = FastAPI(title="milepost engine", version="0.1.0")
    service = GenerateService(engine, info, tokenizer, limits, incremental_stream)
    app.state.service = service
    gauges = Gauges(engine)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        return _error(describe_validation_errors(list(exc.errors())))

    @app.exception_handler(ValidationError)  # a model built inside a handler (OpenAI -> SGLang)
    async def _invalid_inner(_: HttpRequest, exc: ValidationError) -> JSONResponse:
        return _error(describe_validation_errors(exc.errors()))

    @app.exception_handler(BadRequest)
    async def _bad(_: HttpRequest, exc: BadRequest) -> JSONResponse:
        return _error(str(exc), status=413 if isinstance(exc, TooLarge) else 400)

    @app.exception_handler(EngineDown)
    async def _down(_: HttpRequest, exc: EngineDown) -> JSONResponse:
        return _error(str(exc), status=503)

    @app.post("/generate")
    async def generate(body: GenerateReqInput, http: HttpRequest) -> Response:
        seqs = await service.expand(body)
        if body.stream:
            return StreamingResponse(service.stream(seqs, body), media_type="text/event-stream")
        results = await service.run_all(seqs, body, http.is_disconnected)
        single = not body.is_batch and len(seqs) == 1
        return JSONResponse(results[0] if single else results)

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            return JSONResponse(status_code=503, content={"error": {"message": str(engine.error)}})
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        body = GenerateReqInput(input_ids=[0], sampling_params=params, rid=f"health-{uuid.uuid4().hex}")
        await asyncio.wait_for(service.run_all(await service.expand(body), body), 60)
        return Response(status_code=200)

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
    app.include_router(lora_router(engine))  # /load_lora_adapter, /unload_lora_adapter (milepost/lora/)
    app.include_router(openai_router(service, tool_call_family(tool_call_parser)))
    memory = MemoryOccupation(engine)  # release/resume for colocated runs (memory.py)
    app.include_router(memory_router(engine, memory))
    app.add_middleware(MemoryGuard, memory=memory)
    app.include_router(info_router(engine, service, gauges))
    # Outermost: sizes and UTF-8 are checked before any other middleware or route reads the body.
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, limited=GENERATION_ROUTES)
    return app


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message}})


def run_server(args: object) -> None:
    """`milepost serve`: load the model, start the engine thread, serve HTTP until interrupted."""
    import uvicorn

    from milepost.auth import protect, warn_if_exposed
    from milepost.engine.kernel_warmup import start_engine
    from milepost.engine.setup import build_engine

    args = args.resolved()
    engine, info, tokenizer = build_engine(args)
    start_engine(engine, kernel_warmup=not args.skip_kernel_warmup)
    try:
        limits = Limits(max_request_batch=args.max_request_batch)
        app = create_app(engine, info, tokenizer, limits, args.incremental_streaming_output,
                         max_body_bytes=int(args.max_request_body_mb * (1 << 20)),
                         tool_call_parser=args.tool_call_parser)
        protect(app, args.api_key)  # milepost/auth.py: 401 without the key (but /health)
        warn_if_exposed(args.host, args.api_key, "milepost serve", log)
        log.info("serving %s on http://%s:%d", info.model_path, args.host, args.port)
        # A request that waits on a peer (a weight-group rendezvous) must not hold SIGTERM.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=10)
    finally:
        engine.close()
