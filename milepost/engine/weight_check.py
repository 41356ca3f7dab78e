"""`GET /weights_checksum`: a digest of every weight the engine holds, under Hugging Face names.

milepost's own endpoint (SGLang has none): the trainer compares it with digests of what it sent
(milepost.weights.verify). Digests are taken on the engine thread between steps, so no update
is half-applied while reading; that pauses generation for one pass over the weights, which is
why the check is opt-in.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from milepost.engine.engine import Engine
from milepost.weights.verify import tensor_digest


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

    return router
