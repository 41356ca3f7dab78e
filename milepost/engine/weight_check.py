"""`GET /weights_checksum`, `POST /weights_randomize`, `GET /weights_quantized`,
`POST /weights_dequantized`: milepost's weight-check endpoints.

The checksum is a digest of every weight the engine holds, under Hugging Face names; the trainer
compares it with digests of what it sent (milepost.weights.verify). `/weights_randomize` fills
every weight with seeded noise, so the first update after it (`--check-weight-update-equal`) must
write every tensor or the check sees the noise (report 4.4). Tensors stored quantized
(`--quantization fp8`) cannot match a digest of what was sent: the checksum lists them under
`quantized` with their format instead, and `/weights_dequantized` returns their dequantized values
and row scales, which the trainer compares within the format's error bound. All run on the engine
thread between steps, pausing generation for one pass over the weights, which is why they are
opt-in.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from milepost.engine.engine import Engine
from milepost.weights.codec import serialize_named_tensors
from milepost.weights.fp8 import FORMAT
from milepost.weights.verify import tensor_digest


class RandomizeReq(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    seed: int = 0
    prefix: str | None = None  # only names that start with it (a LoRA run: "policy/", its adapter)


class DequantizedReq(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    names: list[str]


def weight_check_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    def fp8_owner(view: torch.Tensor) -> object | None:
        store = getattr(engine.runner.model, "fp8_weights", None)
        return store if store is not None and store.owner(view) is not None else None

    @router.get("/weights_checksum")
    async def weights_checksum() -> dict:
        def run() -> dict:
            model = engine.runner.model
            sums, quantized = {}, {}
            for name in model.hf_weight_names():
                view = model.weight_view(name)
                store = fp8_owner(view)
                if store is not None:
                    quantized[name] = getattr(store, "format", FORMAT)
                else:
                    sums[name] = tensor_digest(view)
            return {"weight_version": engine.weight_version, "algorithm": "sha256",
                    "checksums": sums, "quantized": quantized}

        return await asyncio.wrap_future(engine.call(run))

    @router.get("/weights_quantized")
    async def weights_quantized() -> dict:
        def run() -> dict:  # names only, no pass over the bytes: the trainer asks before updates
            model = engine.runner.model
            names = [n for n in model.hf_weight_names() if fp8_owner(model.weight_view(n))]
            store = getattr(model, "fp8_weights", None)
            return {"format": getattr(store, "format", FORMAT) if names else None, "names": names}

        return await asyncio.wrap_future(engine.call(run))

    @router.post("/weights_dequantized")
    async def weights_dequantized(body: DequantizedReq) -> JSONResponse:
        def run() -> JSONResponse:
            model = engine.runner.model
            out, problems = [], []
            for name in body.names:
                try:
                    view = model.weight_view(name)
                except KeyError:
                    problems.append(f"{name}: unknown name for this model")
                    continue
                store = fp8_owner(view)
                if store is None:
                    problems.append(f"{name}: not stored quantized (compare its checksum)")
                    continue
                values, scale = store.dequantized(view)
                out += [(name, values.cpu()), (f"{name}:scale", scale.cpu())]
            if problems:
                return JSONResponse(status_code=400, content={
                    "success": False, "message": "; ".join(problems)})
            store = getattr(model, "fp8_weights", None)
            return JSONResponse({"success": True, "format": getattr(store, "format", FORMAT),
                                 "tensors": serialize_named_tensors(out)})

        return await asyncio.wrap_future(engine.call(run))

    @router.post("/weights_randomize")
    async def weights_randomize(body: RandomizeReq) -> dict:
        def run() -> dict:
            model = engine.runner.model
            gen = torch.Generator().manual_seed(body.seed)
            names = [n for n in model.hf_weight_names() if n.startswith(body.prefix or "")]
            with torch.no_grad():
                for name in names:
                    view = model.weight_view(name)
                    store = fp8_owner(view)
                    shape = store.hf_shape(view) if hasattr(store, "hf_shape") else view.shape
                    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
                    if store is not None:  # new values and new scales, as an update writes
                        store.write(view, noise)
                    else:
                        view.copy_(noise.to(view.dtype) if view.is_floating_point() else
                                   (noise * 100).to(view.dtype))
            engine.after_weight_update("randomized", flush_cache=True)
            return {"success": True, "message": f"randomized {len(names)} tensors",
                    "weight_version": engine.weight_version}

        return await asyncio.wrap_future(engine.call(run))

    return router
