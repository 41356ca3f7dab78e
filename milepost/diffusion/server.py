"""The diffusion engine's HTTP interface, shaped like the text engine's (SGLang's names).

POST /generate {labels, seed, num_steps, guidance_scale, noise_level, time_shift, return_format}
answers the trajectory as raw bytes (milepost/diffusion/codec.py) or JSON. Weight updates take
SGLang's bodies: /update_weights_from_tensor (the project's safe codec) and
/update_weights_from_disk; /weights_checksum serves milepost.weights.verify. Client errors answer
400 with {"error": {"message": ...}} naming the field. `python -m milepost.diffusion.server --help`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Literal

import numpy as np
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from milepost.diffusion.codec import CONTENT_TYPE, pack, to_json
from milepost.diffusion.engine import DiffusionEngine
from milepost.engine.protocol import (
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDistributedReqInput,
)
from milepost.weights.codec import WeightUpdateError, deserialize_named_tensors
from milepost.weights.process_group import WeightGroupRegistry

MAX_BATCH = 4096
GROUP_SETUP_TIMEOUT_S = 120.0  # a trainer that never joins frees the group's name after this


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    labels: list[int] = Field(min_length=1, max_length=MAX_BATCH)
    seed: int = Field(0, ge=0)
    num_steps: int = Field(8, ge=1, le=1000)
    guidance_scale: float = Field(1.0, ge=0.0, le=100.0)
    noise_level: float = Field(0.7, gt=0.0, le=2.0)
    time_shift: float = Field(1.0, gt=0.0, le=100.0)
    return_format: Literal["bytes", "json"] = "bytes"


class FromTensorBody(BaseModel):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    weight_version: str | None = None


class FromDiskBody(BaseModel):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None


def _fail(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def create_app(engine: DiffusionEngine) -> FastAPI:
    app = FastAPI(title="milepost diffusion engine")
    n_classes = engine.config.num_classes

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_request: object, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in exc.errors()]
        return _fail("; ".join(parts))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict:
        c = engine.config
        return {"model_type": c.model_type, "image_size": c.image_size, "channels": c.channels,
                "num_classes": c.num_classes, "scheduler": "flow_matching"}

    @app.get("/get_weight_version")
    async def weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    @app.post("/generate")
    async def generate(body: GenerateBody) -> Response:
        bad = [x for x in body.labels if not 0 <= x <= n_classes]
        if bad:
            return _fail(f"labels: {bad[:5]} out of range 0..{n_classes} ({n_classes} = unconditional)")
        traj, version = await asyncio.to_thread(
            engine.generate, body.labels, seed=body.seed, num_steps=body.num_steps,
            guidance=body.guidance_scale, noise_level=body.noise_level, shift=body.time_shift)
        meta = {"weight_version": version, "labels": body.labels, "seed": body.seed}
        arrays = {"latents": traj.latents.numpy(), "log_probs": traj.log_probs.numpy(),
                  "timesteps": traj.timesteps.numpy().astype(np.float32)}
        if traj.images is not None:
            arrays["images"] = traj.images.numpy()
        if body.return_format == "json":
            return Response(await asyncio.to_thread(to_json, meta, arrays), media_type="application/json")
        return Response(pack(meta, arrays), media_type=CONTENT_TYPE)

    async def _update(fn, version: str | None) -> JSONResponse:
        try:
            n = await asyncio.to_thread(fn)
        except WeightUpdateError as e:
            return _fail(str(e))
        return JSONResponse({"success": True, "message": f"updated {n} tensors", "weight_version": engine.weight_version})

    @app.post("/update_weights_from_tensor")
    async def from_tensor(body: FromTensorBody) -> JSONResponse:
        if body.load_format not in (None, "direct"):
            return _fail(f"load_format {body.load_format!r} is not supported; use null")
        if len(body.serialized_named_tensors) != 1:
            return _fail(f"serialized_named_tensors: send 1 entry (one rank), got {len(body.serialized_named_tensors)}")
        data = body.serialized_named_tensors[0]
        return await _update(lambda: engine.load_named(deserialize_named_tensors(data), body.weight_version),
                             body.weight_version)

    @app.post("/update_weights_from_disk")
    async def from_disk(body: FromDiskBody) -> JSONResponse:
        if body.load_format not in (None, "auto", "safetensors"):
            return _fail(f"load_format {body.load_format!r} is not supported; use 'safetensors'")
        return await _update(lambda: engine.load_dir(body.model_path, body.weight_version), body.weight_version)

    groups = WeightGroupRegistry()  # --weight-transport broadcast: the text engine's weight groups (gloo)

    @app.post("/init_weights_update_group")
    async def init_group(body: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        if body.backend != "gloo" or body.world_size != 2:
            return _fail(f"backend {body.backend!r}, world_size {body.world_size}: this engine joins a gloo group of "
                         "2 (trainer and engine may share one GPU, where NCCL cannot have both)")
        try:  # the rendezvous blocks until the trainer joins: off the event loop
            await asyncio.to_thread(groups.init, body.master_address, body.master_port, body.rank_offset,
                                    body.world_size, body.group_name, "gloo", setup_timeout_s=GROUP_SETUP_TIMEOUT_S)
        except (WeightUpdateError, ValueError, RuntimeError) as e:
            return _fail(f"init_weights_update_group failed: {e}")
        return JSONResponse({"success": True, "message": f"joined group {body.group_name!r}"})

    @app.post("/update_weights_from_distributed")
    async def from_distributed(body: UpdateWeightsFromDistributedReqInput) -> JSONResponse:
        if body.load_format is not None:
            return _fail(f"load_format {body.load_format!r} is not supported; use null")
        try:
            group = groups.get(body.group_name)
        except (KeyError, WeightUpdateError) as e:
            return _fail(str(e))
        return await _update(lambda: engine.receive_broadcast(group, body.names, body.dtypes, body.shapes,
                                                              body.weight_version), body.weight_version)

    @app.post("/destroy_weights_update_group")
    async def destroy_group(body: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        try:
            await asyncio.to_thread(groups.destroy, body.group_name)
        except WeightUpdateError as e:
            return _fail(str(e))
        return JSONResponse({"success": True, "message": f"left group {body.group_name!r}"})

    @app.get("/weights_checksum")
    async def weights_checksum() -> dict:
        sums = await asyncio.to_thread(engine.checksums)
        return {"weight_version": engine.weight_version, "checksums": sums, "quantized": {}}

    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m milepost.diffusion.server", description=__doc__)
    ap.add_argument("--model-path", required=True, help="tiny DiT directory (prepare writes DIR/base_model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backend", choices=["math", "sdpa"], default="math")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    args = ap.parse_args(argv)
    import torch
    import uvicorn

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.deterministic and args.attention_backend != "math":
        ap.error("--deterministic needs --attention-backend math (sdpa has no deterministic switch)")
    try:
        engine = DiffusionEngine(args.model_path, args.device, args.attention_backend, args.deterministic)
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.WARNING)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
