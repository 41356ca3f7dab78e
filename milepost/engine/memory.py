"""Release and resume the engine's memory for colocated runs (SGLang's memory-occupation protocol).

`POST /release_memory_occupation {"tags": ["kv_cache", "weights"]}` frees the KV pool (with the
routed-expert record kept beside it) and/or the weights, so a trainer on the same device can use
that memory; `POST /resume_memory_occupation` with the same tags brings it back: the KV pool
zeroed (the prefix cache is flushed on release), the weights copied back from the host copy
taken on release. Omitted tags mean both. Tensor objects are kept and only their storage is
freed (resized to 0), so whatever holds a reference to a weight or KV tensor keeps a valid object;
CUDA graphs captured over the old addresses are captured again once everything is resumed
(the runner's `capture_cuda_graphs()`).

Rules (decided here; SGLang asserts the same idleness): release is refused (400) while a request
holds KV (running or paused in place) or a weight update is in flight; wait, or pause with mode
abort or retract first. While anything is released the engine does not step: /generate, the
OpenAI routes and /health_generate answer 503; weight updates, /weights_checksum and
/continue_generation answer 400 naming /resume_memory_occupation. Requests queued before the
release stay queued and run after the resume. /health stays 200: the process is alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from milepost.engine.engine import Engine

MemoryTag = Literal["kv_cache", "weights"]
ALL_TAGS: tuple[MemoryTag, ...] = ("kv_cache", "weights")

# Paths refused while memory is released: 503 = no capacity to generate now; 400 = a call that
# is wrong in this state (the caller must resume first).
_GENERATION_PATHS = ("/generate", "/health_generate", "/v1/completions", "/v1/chat/completions")
_WEIGHT_PATHS = ("/update_weights_from_tensor", "/update_weights_from_disk",
                 "/update_weights_from_distributed", "/weights_checksum")


class MemoryOccupationReqInput(BaseModel):
    """Body of /release_memory_occupation and /resume_memory_occupation (SGLang's fields)."""

    model_config = ConfigDict(extra="forbid")

    tags: list[MemoryTag] | None = Field(
        None, min_length=1,
        description="What to release or resume: kv_cache, weights; omitted = both.",
    )


class MemoryStateError(Exception):
    """The engine is not in a state where this release/resume can run: answered 400."""


class MemoryOccupation:
    """Which memory is released, and the host copies that bring the weights back.

    `release` and `resume` run on the engine thread (through `Engine.call`), between steps.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.released: set[MemoryTag] = set()
        # Per released tag: (a tensor on each freed storage, its bytes, the host copy or None).
        # A tensor, not the storage wrapper, is kept: wrappers are rebuilt on every access.
        self._freed: dict[MemoryTag, list[tuple[torch.Tensor, int, torch.UntypedStorage | None]]] = {}
        self._unpause_on_resume = False
        # HTTP-side state, touched only on the event loop (MemoryGuard and the routes):
        self.weight_calls = 0  # weight-touching requests in flight
        self.releasing = False  # a release of the weights is under way: refuse new weight calls

    # ---- what each tag covers ------------------------------------------------------------------
    def tensors(self, tag: MemoryTag) -> list[torch.Tensor]:
        runner = self.engine.runner
        # A speculative draft model (draft_model.py) has its own KV pools and weights: freed too.
        draft = getattr(getattr(self.engine, "speculator", None), "drafter", None)
        draft_kv, draft_model = getattr(draft, "kv", None), getattr(draft, "model", None)
        if tag == "kv_cache":
            extra = [runner.routed_slots] if runner.routed_slots is not None else []
            if draft_kv is not None:
                extra += [*draft_kv.k, *draft_kv.v]
            return [*runner.kv.k, *runner.kv.v, *extra]
        extra = [*draft_model.parameters(), *draft_model.buffers()] if draft_model is not None else []
        if getattr(runner, "lora", None) is not None:  # LoRA on experts: the base copies (expert_merge.py)
            extra += runner.lora.experts.tensors()
        return [*runner.model.parameters(), *runner.model.buffers(), *extra]

    def held_bytes(self) -> dict[str, int]:
        """Bytes of storage each tag's tensors hold now (0 once released; tied weights once)."""
        return {tag: sum(s.nbytes() for _, s in _storages(self.tensors(tag))) for tag in ALL_TAGS}

    # ---- engine-thread operations --------------------------------------------------------------
    def release(self, tags: list[MemoryTag]) -> int:
        """Free the storage of `tags` (already released ones are skipped); bytes freed."""
        engine = self.engine
        if engine.scheduler.running:
            raise MemoryStateError(
                f"{len(engine.scheduler.running)} requests hold KV cache; wait for them to finish "
                "or POST /pause_generation with mode abort or retract before releasing memory")
        freed = 0
        for tag in (t for t in ALL_TAGS if t in tags and t not in self.released):
            if tag == "kv_cache" and engine.cache is not None:
                engine.cache.reset()  # cached prefixes point into the KV being freed
            records = []
            for owner, storage in _storages(self.tensors(tag)):
                host = _host_copy(storage) if tag == "weights" else None
                records.append((owner, storage.nbytes(), host))
                freed += storage.nbytes()
                storage.resize_(0)
            self._freed[tag] = records
            self.released.add(tag)
        if self.released and engine.paused is None:
            engine.paused = "in_place"  # nothing queued may step over freed memory
            self._unpause_on_resume = True
        _return_cached_memory()
        return freed

    def resume(self, tags: list[MemoryTag]) -> int:
        """Reallocate `tags` (not-released ones are skipped): KV zeroed, weights from the host copy."""
        restored = 0
        for tag in (t for t in ALL_TAGS if t in tags and t in self.released):
            for owner, nbytes, host in self._freed[tag]:
                storage = owner.untyped_storage()
                try:
                    storage.resize_(nbytes)
                except torch.OutOfMemoryError as e:
                    raise MemoryStateError(
                        f"out of memory while resuming {tag} ({nbytes / 2**30:.2f} GiB more): free "
                        "the trainer's memory (offload) first, or lower --mem-fraction-static"
                    ) from e
                if host is not None:
                    storage.copy_(host)
                else:
                    storage.fill_(0)
                restored += nbytes
            del self._freed[tag]  # only now: a resume that ran out of memory can be retried
            self.released.discard(tag)
        if not self.released:
            if self._unpause_on_resume and self.engine.paused == "in_place":
                self.engine.resume()
            self._unpause_on_resume = False
            recapture = getattr(self.engine.runner, "capture_cuda_graphs", None)
            if recapture is not None:  # graphs replay fixed addresses: the new ones differ
                recapture()
            draft = getattr(getattr(self.engine, "speculator", None), "drafter", None)
            if hasattr(draft, "capture_cuda_graphs"):  # the draft model's step graphs, likewise
                draft.capture_cuda_graphs()
        return restored

    def user_paused(self) -> None:
        """/pause_generation while released: the caller now owns the pause; keep it on resume."""
        self._unpause_on_resume = False


def _storages(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.UntypedStorage]]:
    """Each distinct live storage once (tied weights and views share one), with a tensor on it."""
    seen: dict[int, tuple[torch.Tensor, torch.UntypedStorage]] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() > 0:
            seen.setdefault(s.data_ptr(), (t, s))
    return list(seen.values())


def _host_copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    pin = storage.device.type == "cuda"
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
    host.copy_(storage)
    return host


def _return_cached_memory() -> None:
    """Hand freed CUDA blocks back to the driver so another process (the trainer) can use them."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class MemoryGuard:
    """ASGI middleware: refuses what must not run while memory is released (see the module doc),
    and counts weight-touching requests in flight so a release never frees weights under one."""

    def __init__(self, app: Callable, memory: MemoryOccupation) -> None:
        self.app = app
        self.memory = memory

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        refusal = self._refusal(path)
        if refusal is not None:
            status, message = refusal
            await JSONResponse(status_code=status, content={"error": {"message": message}})(
                scope, receive, send)
            return
        if path == "/pause_generation" and self.memory.released:
            self.memory.user_paused()
        if path not in _WEIGHT_PATHS:
            await self.app(scope, receive, send)
            return
        self.memory.weight_calls += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.memory.weight_calls -= 1

    def _refusal(self, path: str) -> tuple[int, str] | None:
        released = sorted(self.memory.released)
        if path in _WEIGHT_PATHS and (self.memory.releasing or "weights" in released):
            return 400, (f"{path}: the weights are released; POST /resume_memory_occupation with "
                         'tags ["weights"] first')
        if not released:
            return None
        if path in _GENERATION_PATHS:
            return 503, (f"memory is released ({', '.join(released)}): the engine cannot generate "
                         "until POST /resume_memory_occupation")
        if path == "/continue_generation":
            return 400, (f"memory is released ({', '.join(released)}); POST "
                         "/resume_memory_occupation first, then /continue_generation")
        return None


def memory_router(engine: Engine, memory: MemoryOccupation) -> APIRouter:
    router = APIRouter()

    def fail(message: str) -> JSONResponse:
        return JSONResponse(status_code=400, content={"success": False, "message": message})

    @router.post("/release_memory_occupation")
    async def release(body: MemoryOccupationReqInput | None = None) -> JSONResponse:
        tags = list((body.tags if body else None) or ALL_TAGS)
        if "weights" in tags and memory.weight_calls:
            return fail(f"{memory.weight_calls} weight update(s) in flight; release after they end")
        memory.releasing = "weights" in tags  # no new weight call may start meanwhile
        try:
            freed = await asyncio.wrap_future(engine.call(lambda: memory.release(tags)))
        except MemoryStateError as e:
            return fail(f"memory not released: {e}")
        finally:
            memory.releasing = False
        return JSONResponse({"success": True, "message": f"released {', '.join(tags)}",
                             "freed_bytes": freed, "released": sorted(memory.released)})

    @router.post("/resume_memory_occupation")
    async def resume(body: MemoryOccupationReqInput | None = None) -> JSONResponse:
        tags = list((body.tags if body else None) or ALL_TAGS)
        try:
            restored = await asyncio.wrap_future(engine.call(lambda: memory.resume(tags)))
        except MemoryStateError as e:
            return fail(f"memory not resumed: {e}")
        return JSONResponse({"success": True, "message": f"resumed {', '.join(tags)}",
                             "restored_bytes": restored, "released": sorted(memory.released)})

    @router.get("/memory_occupation")
    async def occupation() -> dict:
        """milepost's addition: what is released and the bytes each tag's tensors hold now."""
        held = await asyncio.wrap_future(engine.call(memory.held_bytes))
        return {"released": sorted(memory.released), "held_bytes": held}

    return router
