"""The engine's side of disk-delta updates (milepost.weights.disk_delta), in two phases.

`/weights_delta/prepare` pulls a version from the shared store, patches this engine's host copy
(a candidate, the copy itself is untouched), checks every tensor's digest and stages the result
against the model (names, shapes, dtypes, finite values, every weight present) - all off the
engine thread, so generation goes on.
`/weights_delta/commit` then loads the staged state between steps and adopts the candidate;
`/weights_delta/discard` drops it. A refused prepare leaves weights, copy and version as they were.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from milepost.engine.engine import Engine
from milepost.engine.weight_update import WeightLoader
from milepost.weights.codec import WeightUpdateError
from milepost.weights.delta_replica import DeltaReplica
from milepost.weights.disk_delta import DeltaError, DeltaIndex


class DeltaPrepareReq(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    root: str = Field(min_length=1)
    version: int = Field(ge=0)


class DeltaCommitReq(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    version: int = Field(ge=0)
    weight_version: str | None = None
    flush_cache: bool = True


class _Prepared:
    def __init__(self, index: DeltaIndex, state: dict[str, torch.Tensor],
                 pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.index, self.state, self.pairs = index, state, pairs


def _fail(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(status_code=status, content={"success": False, "message": message})


def weight_delta_router(engine: Engine) -> APIRouter:
    router = APIRouter()
    loader = WeightLoader(engine.runner.model)
    replica = DeltaReplica()
    lock = threading.Lock()  # one prepare/commit at a time
    box: dict[str, _Prepared | None] = {"pending": None}

    @router.post("/weights_delta/prepare")
    async def prepare(body: DeltaPrepareReq) -> JSONResponse:
        root = Path(body.root)
        if not root.is_dir():
            return _fail(f"delta store {body.root!r} is not a directory on this engine's host; "
                         "disk-delta needs a filesystem both sides see at the same path")

        def run() -> _Prepared:
            with lock:
                box["pending"] = None
                index, state = replica.prepare(root, body.version)
                pairs = loader.stage(state.items(), strict_dtype=True)
                # A full version (or a chain built on one) must hold every weight: loading part
                # of a model would serve a mix of two versions.
                missing = loader.missing_weights(pairs)
                if missing:
                    raise WeightUpdateError(
                        f"delta version {body.version} lacks {len(missing)} of this model's "
                        f"weights (first: {missing[:3]}); a full version must hold every weight")
                prepared = _Prepared(index, state, pairs)
                box["pending"] = prepared
                return prepared

        try:
            p = await asyncio.to_thread(run)
        except (DeltaError, WeightUpdateError) as e:
            return _fail(f"weights unchanged: {e}")
        return JSONResponse({"success": True, "version": p.index.version,
                             "message": f"prepared {len(p.index.tensors)} changed tensors"})

    @router.post("/weights_delta/commit")
    async def commit(body: DeltaCommitReq) -> JSONResponse:
        with lock:
            p = box["pending"]
            if p is None or p.index.version != body.version:
                held = "nothing" if p is None else f"version {p.index.version}"
                return _fail(f"commit of delta version {body.version}, but this engine prepared "
                             f"{held}; call /weights_delta/prepare first")
            box["pending"] = None

        def run() -> int:
            loader.commit(p.pairs)
            replica.adopt(p.index.version, p.state)
            engine.after_weight_update(body.weight_version or p.index.weight_version,
                                       body.flush_cache)
            return len(p.pairs)

        n = await asyncio.wrap_future(engine.call(run))
        return JSONResponse({"success": True, "message": f"loaded {n} tensors",
                             "weight_version": engine.weight_version})

    @router.post("/weights_delta/discard")
    async def discard() -> JSONResponse:
        with lock:
            box["pending"] = None
        return JSONResponse({"success": True, "message": "nothing prepared"})

    @router.get("/weights_delta/state")
    async def state() -> JSONResponse:
        return JSONResponse({"version": replica.version, "weight_version": engine.weight_version})

    return router
