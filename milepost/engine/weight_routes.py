"""SGLang's weight-update endpoints: from tensor, from disk, over a torch.distributed group.

Each update is checked whole before anything is copied (WeightLoader.stage), so a refused update
leaves the old weights fully in place and answers 400 naming the tensors at fault. Updates from
tensors and over a group insist on the engine's dtype (a silent cast would hide a trainer
exporting the wrong precision); updates from disk cast, as loading a checkpoint does. A broadcast
is received and checked off the engine thread, so generation goes on until the trainer has sent
everything; only the copy into the model runs between steps.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from milepost.engine.engine import Engine
from milepost.engine.protocol import (
    DestroyWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightsFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from milepost.engine.weight_update import WeightLoader
from milepost.weights.codec import WeightUpdateError
from milepost.weights.process_group import WeightGroupRegistry


class _ReceiveOnly(WeightLoader):
    """A loader that stages (receives, checks) but keeps the commit for later, in `pending`.

    Every WeightLoader source stages whole and then calls `commit` once, so deferring `commit`
    defers exactly the part that must run between engine steps.
    """

    def __init__(self, model: object) -> None:
        super().__init__(model)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def commit(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pending = list(pairs)


class UpdateWeightsFromP2PReqInput(BaseModel):
    """milepost's peer-to-peer bucket (milepost.weights.p2p): metadata here, bytes by recv."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    src_rank: int = Field(0, ge=0)
    # Same host and CUDA: a CUDA IPC handle to the source's staging buffer (p2p_ipc.py); the
    # bucket is copied from there and the group is not used.
    ipc_handle: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


T = TypeVar("T")
# A rendezvous with an unreachable master gives up after this (the trainer starts its side at
# the same moment, so a real one takes seconds); its group name is then free again.
GROUP_SETUP_TIMEOUT_S = 120.0
MAX_PENDING_SETUPS = 4  # more at once is refused (429): each holds a thread until it ends


def _fail(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(status_code=status, content={"success": False, "message": message})


async def _own_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a daemon thread of its own. A call that blocks on a peer (a rendezvous, a
    broadcast that never comes) then holds no worker of the loop's shared pool, which the
    server's other blocking work needs, and does not keep the process alive at SIGTERM."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.cancelled():
            done.set_exception(error) if error is not None else done.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the server's loop is gone (shutting down): nobody waits
            pass

    threading.Thread(target=run, daemon=True, name=f"weights-{fn.__name__}").start()
    return await done


def weight_router(engine: Engine) -> APIRouter:
    router = APIRouter()
    loader = WeightLoader(engine.runner.model)
    groups = WeightGroupRegistry()
    engine.on_close(groups.close)

    async def update(load: Callable[[], int], version: str | None, flush: bool, abort_all: bool,
                     ) -> JSONResponse:
        def run() -> int:
            if abort_all:
                engine.abort_all("aborted by a weight update (abort_all_requests)")
            n = load()
            engine.after_weight_update(version, flush)
            return n

        try:
            n = await asyncio.wrap_future(engine.call(run))
        except WeightUpdateError as e:
            return _fail(f"weights unchanged: {e}")
        return JSONResponse({"success": True, "message": f"updated {n} tensors",
                             "weight_version": engine.weight_version})

    @router.post("/update_weights_from_tensor")
    async def from_tensor(body: UpdateWeightsFromTensorReqInput) -> JSONResponse:
        if body.load_format not in (None, "direct"):
            return _fail(f"load_format {body.load_format!r} is not supported; use null")
        if len(body.serialized_named_tensors) != 1:
            return _fail("serialized_named_tensors: this engine has one tensor-parallel rank; "
                         f"send 1 entry, got {len(body.serialized_named_tensors)}")
        data = body.serialized_named_tensors[0]
        return await update(lambda: loader.from_tensors(data, strict_dtype=True),
                            body.weight_version, body.flush_cache, body.abort_all_requests)

    @router.post("/update_weights_from_disk")
    async def from_disk(body: UpdateWeightsFromDiskReqInput) -> JSONResponse:
        if body.load_format not in (None, "auto", "safetensors"):
            return _fail(f"load_format {body.load_format!r} is not supported; use 'safetensors'")
        return await update(lambda: loader.from_disk(body.model_path),
                            body.weight_version, body.flush_cache, body.abort_all_requests)

    # Setups in progress, counted until their thread ends (not their request: a client that
    # leaves does not end the rendezvous).
    slots = threading.BoundedSemaphore(MAX_PENDING_SETUPS)

    def setup(body: InitWeightsUpdateGroupReqInput) -> None:
        try:
            groups.init(body.master_address, body.master_port, body.rank_offset, body.world_size,
                        body.group_name, body.backend, setup_timeout_s=GROUP_SETUP_TIMEOUT_S)
        finally:
            slots.release()

    @router.post("/init_weights_update_group")
    async def init_group(body: InitWeightsUpdateGroupReqInput) -> JSONResponse:
        if not slots.acquire(blocking=False):
            return _fail(f"{MAX_PENDING_SETUPS} weight-group setups are already waiting for "
                         f"their masters (each gives up after {GROUP_SETUP_TIMEOUT_S:.0f} s); "
                         "retry when one is done", status=429)
        try:  # rendezvous with the trainer blocks: keep it off the event loop and the engine
            await _own_thread(setup, body)
        except (WeightUpdateError, ValueError, RuntimeError) as e:
            return _fail(f"init_weights_update_group failed: {e}")
        return JSONResponse({"success": True, "message": f"joined group {body.group_name!r}"})

    @router.post("/update_weights_from_distributed")
    async def from_distributed(body: UpdateWeightsFromDistributedReqInput) -> JSONResponse:
        if body.load_format is not None:
            return _fail(f"load_format {body.load_format!r} is not supported; use null")
        try:
            group = groups.get(body.group_name)
        except (KeyError, WeightUpdateError) as e:
            return _fail(str(e))

        def receive() -> list[tuple[torch.Tensor, torch.Tensor]]:
            # Not on the engine thread: it would stop generating (and answering pause, flush,
            # other updates) until the trainer's broadcasts arrive, however late they are.
            staged = _ReceiveOnly(engine.runner.model)
            staged.from_distributed(group, body.names, body.dtypes, body.shapes, strict_dtype=True)
            return staged.pending

        try:
            pairs = await _own_thread(receive)
        except WeightUpdateError as e:
            return _fail(f"weights unchanged: {e}")

        def commit() -> int:
            loader.commit(pairs)
            return len(pairs)

        return await update(commit, body.weight_version, body.flush_cache, body.abort_all_requests)

    @router.post("/update_weights_from_p2p")
    async def from_p2p(body: UpdateWeightsFromP2PReqInput) -> JSONResponse:
        group = None
        if body.ipc_handle is None:
            try:
                group = groups.get(body.group_name)
            except (KeyError, WeightUpdateError) as e:
                return _fail(str(e))

        def receive() -> list[tuple[torch.Tensor, torch.Tensor]]:
            staged = _ReceiveOnly(engine.runner.model)  # off the engine thread, as above
            staged.from_p2p(group, body.src_rank, body.names, body.dtypes, body.shapes,
                            strict_dtype=True, ipc_handle=body.ipc_handle)
            return staged.pending

        try:
            pairs = await _own_thread(receive)
        except (WeightUpdateError, ValueError) as e:
            return _fail(f"weights unchanged: {e}")

        def commit() -> int:
            loader.commit(pairs)
            return len(pairs)

        return await update(commit, body.weight_version, body.flush_cache, body.abort_all_requests)

    @router.get("/weights_p2p_info")
    async def p2p_info() -> dict:
        # What a P2P source needs to choose CUDA IPC: the model's device and the GPUs this
        # process sees, in index order (an IPC handle opens on the sender's device index).
        device = next(engine.runner.model.parameters()).device
        uuids = ([str(torch.cuda.get_device_properties(i).uuid)
                  for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else [])
        return {"device": str(device), "cuda_uuids": uuids}

    @router.post("/destroy_weights_update_group")
    async def destroy_group(body: DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        try:
            # Off the event loop: shutting a group down can wait on a peer that vanished.
            await _own_thread(groups.destroy, body.group_name)
        except (KeyError, WeightUpdateError) as e:
            return _fail(str(e))
        return JSONResponse({"success": True, "message": f"left group {body.group_name!r}"})

    @router.post("/update_weight_version")
    async def set_version(body: UpdateWeightVersionReqInput) -> JSONResponse:
        def run() -> None:
            if body.abort_all_requests:
                engine.abort_all("aborted by a weight version update (abort_all_requests)")
            engine.after_weight_update(body.new_version, flush_cache=False)

        await asyncio.wrap_future(engine.call(run))
        return JSONResponse({"success": True, "message": "weight version updated",
                             "weight_version": engine.weight_version})

    return router
