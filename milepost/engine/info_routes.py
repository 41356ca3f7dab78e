"""SGLang's information endpoints: load, model and server info, tokenizer, weights by name.

`/get_load` is what sglang-router polls for `power_of_two` (and `min_load` reads): one entry per
data-parallel rank (here one) with `num_reqs`, `num_waiting_reqs` and `num_tokens` (KV tokens in
use). `/v1/loads` is the newer, richer form. `/model_info` and `/server_info` are the current
names of `/get_model_info` and `/get_server_info` (both kept; the router tries the new ones first).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import torch
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from milepost.engine.engine import Engine

if TYPE_CHECKING:
    from milepost.engine.generate_service import GenerateService

# Routes whose bodies the size limit (--max-request-body-mb) applies to.
GENERATION_ROUTES = ("/generate", "/v1/", "/tokenize", "/detokenize")


class Gauges:
    """SGLang's gauges for /metrics, /get_server_info and the load endpoints.

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


class TokenizeReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int] | list[list[int]]
    model: str | None = None


class GetWeightsByNameReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    truncate_size: int = Field(100, ge=1)


def info_router(engine: Engine, service: GenerateService, gauges: Gauges) -> APIRouter:
    from milepost.engine.generate_service import BadRequest

    router = APIRouter()
    info = service.info

    def model_info() -> dict:
        return {"model_path": info.model_path, "tokenizer_path": info.tokenizer_path,
                "is_generation": True, "weight_version": engine.weight_version,
                "context_length": info.context_length, "vocab_size": info.vocab_size}

    async def server_info() -> dict:
        return {**info.server_args, "dp_size": 1, "tp_size": 1,
                "weight_version": engine.weight_version, "paused": engine.paused,
                **await gauges.read()}

    for path in ("/get_model_info", "/model_info"):
        router.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        router.add_api_route(path, server_info, methods=["GET"])

    @router.get("/get_load")
    async def get_load() -> list[dict]:
        g = await gauges.read()
        running, waiting = int(g["num_running_reqs"]), int(g["num_queue_reqs"])
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                 "num_tokens": int(g["num_used_tokens"])}]

    @router.get("/v1/loads")
    async def loads() -> dict:
        g = await gauges.read()
        running, waiting = int(g["num_running_reqs"]), int(g["num_queue_reqs"])
        load = {
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting, "num_used_tokens": int(g["num_used_tokens"]),
            "max_total_num_tokens": int(g["max_total_num_tokens"]), "token_usage": g["token_usage"],
            "gen_throughput": engine.stats.generation_throughput(),
            "cache_hit_rate": g["cache_hit_rate"],
            "max_running_requests": engine.cfg.max_running_requests,
            "utilization": running / max(1, engine.cfg.max_running_requests),
        }
        return {"timestamp": time.time(), "dp_rank_count": 1, "loads": [load],
                "aggregate": {k: v for k, v in load.items() if k != "dp_rank"}}

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": info.model_path, "object": "model", "created": int(time.time()),
            "owned_by": "milepost", "root": info.model_path, "max_model_len": info.context_length}]}

    @router.post("/tokenize")
    async def tokenize(body: TokenizeReqInput) -> dict:
        if service.tokenizer is None:
            raise BadRequest("prompt: this model has no tokenizer")
        texts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        names = [f"prompt[{i}]" if isinstance(body.prompt, list) else "prompt"
                 for i in range(len(texts))]
        for text, name in zip(texts, names):
            service.tokenize(text, name)  # the size cap, before any work
        loop = asyncio.get_running_loop()
        tok = service.tokenizer
        ids = await loop.run_in_executor(service._pool, lambda: [
            list(tok.encode(t, add_special_tokens=body.add_special_tokens)) for t in texts])
        if isinstance(body.prompt, list):
            return {"tokens": ids, "count": [len(i) for i in ids], "max_model_len": info.context_length}
        return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": info.context_length}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeReqInput) -> dict:
        if service.tokenizer is None:
            raise BadRequest("tokens: this model has no tokenizer")
        batch = bool(body.tokens) and isinstance(body.tokens[0], list)
        rows = body.tokens if batch else [body.tokens]
        for i, row in enumerate(rows):
            bad = [t for t in row if not 0 <= t < info.vocab_size]
            if bad:
                where = f"tokens[{i}]" if batch else "tokens"
                raise BadRequest(f"{where}: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {info.vocab_size})")
        texts = [service.tokenizer.decode(r) for r in rows]
        return {"text": texts if batch else texts[0]}

    @router.post("/get_weights_by_name")
    async def weights_by_name(body: GetWeightsByNameReqInput) -> list:
        def run() -> list:
            try:
                view = engine.runner.model.weight_view(body.name)
            except KeyError as e:
                raise BadRequest(f"name: {e.args[0] if e.args else body.name}") from e
            return view[: body.truncate_size].detach().to("cpu", torch.float32).tolist()

        return await asyncio.wrap_future(engine.call(run))

    return router
