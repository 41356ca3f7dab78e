"""`GET /weights_checksum` and `POST /weights_randomize`: milepost's weight-check endpoints.

The checksum is a digest of every weight the engine holds, under Hugging Face names; the trainer
compares it with digests of what it sent (milepost.weights.verify). `/weights_randomize` fills
every weight with seeded noise, so the first update after it (`--check-weight-update-equal`) must
write every tensor or the check sees the noise (report 4.4). Both run on the engine thread between
steps, pausing generation for one pass over the weights, which is why they are opt-in.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from milepost.engine.engine import Engine
from milepost.weights.verify import tensor_digest


class RandomizeReq(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0


def weight_check_router(engine: Engine) -> APIRouter:
    router = APIRouter()

    @router.get("/weights_checksum")
    async def weights_checksum() -> dict:
        def run() -> dict:
            model = engine.runner.model
            sums = {name: tensor_digest(model.weight_view(name)) for name in model.hf_weight_names()}
            return {"weight_version": engine.weight_version, "algorithm": "sha256",
                    "checksums": sums}

        return await asyncio.wrap_future(engine.call(run))

    @router.post("/weights_randomize")
    async def weights_randomize(body: RandomizeReq) -> dict:
        def run() -> dict:
            model = engine.runner.model
            gen = torch.Generator().manual_seed(body.seed)
            names = model.hf_weight_names()
            with torch.no_grad():
                for name in names:
                    view = model.weight_view(name)
                    noise = torch.randn(view.shape, generator=gen, dtype=torch.float32)
                    view.copy_(noise.to(view.dtype) if view.is_floating_point() else
                               (noise * 100).to(view.dtype))
            engine.after_weight_update("randomized", flush_cache=True)
            return {"success": True, "message": f"randomized {len(names)} tensors",
                    "weight_version": engine.weight_version}

        return await asyncio.wrap_future(engine.call(run))

    return router
