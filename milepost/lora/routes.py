"""SGLang's adapter endpoints on the embedded engine, and the hooks that put an `AdapterPool` in it.

`POST /load_lora_adapter` {lora_name, lora_path, pinned} and `POST /unload_lora_adapter`
{lora_name} answer SGLang's `LoRAUpdateResult` ({success, error_message, loaded_adapters}); a bad
adapter is a 400 naming it, and the engine keeps serving the others. Adapter tensors are addressed
by weight updates and checksums as `<adapter>/<name>` (e.g.
`policy/model.layers.0.self_attn.q_proj.lora_A.weight`), next to the base's Hugging Face names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from milepost.lora.serving import AdapterError, AdapterPool
from milepost.lora.settings import (
    ADAPTER_SEP as SEP,  # "/" never occurs in a Hugging Face tensor name
)


class LoadLoRAAdapterReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang: never evicted; every adapter here stays until unloaded


class UnloadLoRAAdapterReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str


def install_names(model: object, pool: AdapterPool) -> None:
    """Let the model's `weight_view` / `hf_weight_names` address loaded adapters' tensors too, so
    every weight-update path and `/weights_checksum` cover them (`<adapter>/<tensor name>`)."""
    base_view: Callable[[str], torch.Tensor] = model.weight_view
    base_names: Callable[[], list[str]] = model.hf_weight_names

    def weight_view(name: str) -> torch.Tensor:
        if SEP not in name:  # merged expert weights: their base copy (milepost/lora/expert_merge.py)
            return pool.experts.base_view(name, base_view(name))
        adapter, tensor = name.split(SEP, 1)
        entry = pool.loaded.get(adapter)
        if entry is None:
            raise KeyError(f"LoRA adapter {adapter!r} is not loaded (loaded: {sorted(pool.loaded)}); "
                           "load it with POST /load_lora_adapter before updating its weights")
        if tensor not in entry.names:
            raise KeyError(f"{tensor!r} is not a tensor of LoRA adapter {adapter!r}")
        return pool.view(adapter, tensor)

    def hf_weight_names() -> list[str]:
        return base_names() + [f"{a}{SEP}{n}" for a, e in pool.loaded.items() for n in e.names]

    model.weight_view = weight_view  # type: ignore[attr-defined]
    model.hf_weight_names = hf_weight_names  # type: ignore[attr-defined]
    model.after_weight_commit = pool.after_weight_commit  # type: ignore[attr-defined]


def _result(pool: AdapterPool, error: str | None = None) -> JSONResponse:
    body = {"success": error is None, "error_message": error, "loaded_adapters": pool.paths()}
    return JSONResponse(body, status_code=200 if error is None else 400)


def lora_router(engine: object) -> APIRouter:
    """Routes of an engine whose runner has an AdapterPool (`--enable-lora`), else ones that refuse."""
    router = APIRouter()

    def pool_or_error() -> AdapterPool | JSONResponse:
        pool = getattr(engine.runner, "lora", None)
        if pool is None:
            return JSONResponse({"success": False, "loaded_adapters": {},
                                 "error_message": "this engine serves no LoRA adapters: start it with "
                                 "--enable-lora (and --max-lora-rank, --lora-target-modules)"},
                                status_code=400)
        return pool

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterReqInput) -> JSONResponse:
        pool = pool_or_error()
        if isinstance(pool, JSONResponse):
            return pool

        def run() -> JSONResponse:
            if SEP in body.lora_name:
                return _result(pool, f"lora_name {body.lora_name!r}: must not contain {SEP!r}")
            try:
                pool.load(body.lora_name, body.lora_path)
            except AdapterError as e:
                return _result(pool, str(e))
            # Experts merged: requests of the base (or another adapter) would now see its deltas.
            engine.abort_where(lambda r: pool.refusal(r.lora_name) is not None,
                               f"LoRA adapter {body.lora_name!r} was merged into the expert weights")
            return _result(pool)

        return await asyncio.wrap_future(engine.call(run))

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterReqInput) -> JSONResponse:
        pool = pool_or_error()
        if isinstance(pool, JSONResponse):
            return pool

        def run() -> JSONResponse:
            if body.lora_name not in pool.loaded:
                return _result(pool, f"lora_name: adapter {body.lora_name!r} is not loaded; "
                                     f"loaded: {sorted(pool.loaded)}")
            # Requests still using it end now (abort), rather than finish on the base model.
            engine.abort_where(lambda r: r.lora_name == body.lora_name,
                               f"LoRA adapter {body.lora_name!r} was unloaded")
            pool.unload(body.lora_name)
            return _result(pool)

        return await asyncio.wrap_future(engine.call(run))

    return router


def start_adapter_pool(model: object, args: object, device: torch.device, dtype: torch.dtype) -> AdapterPool:
    """`--enable-lora`: the pool over `model`'s projections, `--lora-paths` loaded (a bad one stops
    the start, naming it), adapter tensors addressable by weight updates."""
    from milepost.lora.settings import parse_target_modules

    pool = AdapterPool(model, parse_target_modules(args.lora_target_modules), args.max_lora_rank,
                       args.max_loras_per_batch, device, dtype)
    for spec in (args.lora_paths or "").split(",") if args.lora_paths else []:
        name, path = spec.split("=", 1)
        try:
            pool.load(name, path)
        except AdapterError as e:
            raise ValueError(f"--lora-paths {spec}: {e}") from None
    install_names(model, pool)
    return pool
